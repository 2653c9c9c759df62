"""Hostile GGUF files: every count, length and hyperparameter a header declares is checked before
it becomes an allocation, and every refusal is one line naming the field.

A tiny GGUF writer (struct-packed: magic, version 3, tensor count, key/value count, pairs, tensor
infos, aligned zero data) makes a valid one-layer Llama, which converts, and variants of it that
each break one thing: a huge ``block_count``, tensor count or array length, millions of empty
strings, a string or a tensor's data past the end of the file, negative or ragged dims, NaN and
infinite hyperparameters, unknown value and tensor types, a truncated header. Each must raise
one ``ValueError`` line naming the field from both ways a GGUF file is read (the conversion
``--model x.gguf`` runs and the engine's read of the file's tensors) while Python allocates less
than ``MEMORY_BOUND`` (tracemalloc's peak: memory, not time). ``inflight serve`` prints that line,
no traceback, and exits non-zero.
"""

from __future__ import annotations

import math
import os
import re
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from inflight.runtime.model.gguf_convert import check_supported
from inflight.runtime.model.gguf_index import open_gguf
from inflight.runtime.model.gguf_source import resolve_model_dir

MEMORY_BOUND = 64 << 20
U8, I32, U32, F32V, BOOL, STR, ARR, U64 = 0, 5, 4, 6, 7, 8, 9, 10
_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
F32, Q8_0 = 0, 8  # GGML tensor types
ALIGN = 32


def gstr(text: str | bytes, order: str = "<") -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack(order + "Q", len(raw)) + raw


def encode(vtype: int, value: Any, order: str = "<") -> bytes:
    if vtype == STR:
        return gstr(value, order)
    if vtype == ARR:
        item, items = value
        return struct.pack(order + "IQ", item, len(items)) + b"".join(encode(item, x, order) for x in items)
    return struct.pack(order + _FMT[vtype], value)


@dataclass
class TinyModel:
    """A one-layer Llama (hidden 8, two heads of 4, one KV head, vocabulary of 4) as GGUF parts
    a test can break one at a time; :meth:`write` packs them."""

    meta: dict[str, tuple[int, Any]]
    tensors: dict[str, tuple[list[int], int]]  # name -> (GGUF dims, GGML type)
    extra_pairs: list[bytes] = field(default_factory=list)  # raw key/value pairs appended
    offsets: dict[str, int] = field(default_factory=dict)  # data offsets to use instead
    tensor_count: int | None = None
    kv_count: int | None = None

    def write(self, path: Path, cut: int | None = None, order: str = "<") -> Path:
        """The file (``order``: ``>`` for a big-endian one), cut after ``cut`` bytes if given."""
        out = b"GGUF" + struct.pack(order + "IQQ", 3,
                                    len(self.tensors) if self.tensor_count is None else self.tensor_count,
                                    len(self.meta) + len(self.extra_pairs) if self.kv_count is None else self.kv_count)
        out += b"".join(gstr(k, order) + struct.pack(order + "I", t) + encode(t, v, order)
                        for k, (t, v) in self.meta.items())  # fmt: skip
        out += b"".join(self.extra_pairs)
        data_size = 0
        for name, (dims, gtype) in self.tensors.items():
            out += gstr(name, order) + struct.pack(f"{order}I{len(dims)}Q", len(dims), *dims)
            out += struct.pack(order + "IQ", gtype, self.offsets.get(name, data_size))
            data_size += -(-_nbytes(dims, gtype) // ALIGN) * ALIGN
        out += bytes(-len(out) % ALIGN) + bytes(data_size)
        path.write_bytes(out if cut is None else out[:cut])
        return path


def _nbytes(dims: list[int], gtype: int) -> int:
    n = math.prod(dims)
    size = n * 4 if gtype == F32 else n // 32 * 34
    return size if 0 <= size < 1 << 20 else 0  # a hostile shape gets no data


def tiny_model() -> TinyModel:
    h, f, v, q, kv = 8, 16, 4, 8, 4
    layer = {"attn_norm": [h], "attn_q": [h, q], "attn_k": [h, kv], "attn_v": [h, kv], "attn_output": [q, h],
             "ffn_norm": [h], "ffn_gate": [h, f], "ffn_up": [h, f], "ffn_down": [f, h]}  # fmt: skip
    tensors = {"token_embd.weight": ([h, v], F32), "output_norm.weight": ([h], F32)}
    tensors |= {f"blk.0.{name}.weight": (dims, F32) for name, dims in layer.items()}
    meta = {
        "general.architecture": (STR, "llama"),
        "llama.block_count": (U32, 1),
        "llama.context_length": (U32, 64),
        "llama.embedding_length": (U32, h),
        "llama.feed_forward_length": (U32, f),
        "llama.attention.head_count": (U32, 2),
        "llama.attention.head_count_kv": (U32, 1),
        "llama.rope.dimension_count": (U32, 4),
        "llama.rope.freq_base": (F32V, 10000.0),
        "llama.attention.layer_norm_rms_epsilon": (F32V, 1e-5),
        "tokenizer.ggml.model": (STR, "gpt2"),
        "tokenizer.ggml.tokens": (ARR, (STR, ["<s>", "</s>", "a", "b"])),
        "tokenizer.ggml.token_type": (ARR, (I32, [3, 3, 1, 1])),
        "tokenizer.ggml.merges": (ARR, (STR, [])),
        "tokenizer.ggml.bos_token_id": (U32, 0),
        "tokenizer.ggml.eos_token_id": (U32, 1),
    }
    return TinyModel(meta, tensors)


def _pair(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def _set(key: str, vtype: int, value: Any) -> Callable[[TinyModel], None]:
    def change(m: TinyModel) -> None:
        m.meta[key] = (vtype, value)

    return change


def _duplicate_key(m: TinyModel) -> None:
    m.extra_pairs.append(_pair("llama.block_count", U32, struct.pack("<I", 1)))


def _huge_tensor_count(m: TinyModel) -> None:
    m.tensor_count = 1 << 40


def _huge_kv_count(m: TinyModel) -> None:
    m.kv_count = (1 << 64) - 1


def _declared_array(key: str, item: int, count: int) -> Callable[[TinyModel], None]:
    """``key`` as an array that declares ``count`` items and holds none."""

    def change(m: TinyModel) -> None:
        del m.meta[key]
        m.extra_pairs.append(_pair(key, ARR, struct.pack("<IQ", item, count)))

    return change


def _string_past_eof(m: TinyModel) -> None:
    m.extra_pairs.append(_pair("general.name", STR, struct.pack("<Q", 1 << 40) + b"x"))


def _unknown_value_type(m: TinyModel) -> None:
    m.extra_pairs.append(_pair("general.mystery", 99, b"\0" * 8))


def _unknown_array_type(m: TinyModel) -> None:
    m.extra_pairs.append(_pair("general.mystery", ARR, struct.pack("<IQ", 77, 1) + b"\0" * 8))


def _nested_too_deep(m: TinyModel) -> None:
    m.extra_pairs.append(_pair("general.deep", ARR, struct.pack("<IQ", ARR, 1) * 64 + struct.pack("<IQ", U8, 0)))


def _dims(name: str, dims: list[int], gtype: int = F32) -> Callable[[TinyModel], None]:
    def change(m: TinyModel) -> None:
        m.tensors[name] = (dims, gtype)

    return change


def _offset(name: str, offset: int) -> Callable[[TinyModel], None]:
    def change(m: TinyModel) -> None:
        m.offsets[name] = offset

    return change


def _unknown_tensor_type(m: TinyModel) -> None:
    m.tensors["output_norm.weight"] = ([8], 1000)


def _stray_layer(m: TinyModel) -> None:
    m.tensors["blk.7.attn_norm.weight"] = ([8], F32)


def _no_embedding(m: TinyModel) -> None:
    del m.tensors["token_embd.weight"]


# (id, the change, the field the one-line error must name)
HOSTILE: list[tuple[str, Callable[[TinyModel], None], str]] = [
    ("huge-block-count", _set("llama.block_count", U32, 1 << 24), "llama.block_count"),
    ("block-count-beyond-layers", _set("llama.block_count", U32, 3), "llama.block_count"),
    ("huge-tensor-count", _huge_tensor_count, "header.tensor_count"),
    ("huge-kv-count", _huge_kv_count, "header.kv_count"),
    ("huge-array-length", _declared_array("tokenizer.ggml.token_type", I32, 1 << 50), "tokenizer.ggml.token_type"),
    ("4M-empty-strings-declared", _declared_array("tokenizer.ggml.tokens", STR, 4 << 20), "tokenizer.ggml.tokens"),
    ("200k-empty-strings-held", _set("tokenizer.ggml.tokens", ARR, (STR, [""] * 200_000)), "tokenizer.ggml.tokens"),
    ("string-past-eof", _string_past_eof, "general.name"),
    ("negative-dim", _dims("token_embd.weight", [8, (1 << 64) - 1]), "tensor token_embd.weight"),
    ("zero-dim", _dims("output_norm.weight", [0]), "tensor output_norm.weight"),
    ("ragged-quant-rows", _dims("blk.0.attn_q.weight", [33, 8], Q8_0), "tensor blk.0.attn_q.weight"),
    ("nine-dims", _dims("output_norm.weight", [1] * 9), "tensor output_norm.weight"),
    ("dims-disagree", _dims("blk.0.ffn_down.weight", [16, 9]), "tensor blk.0.ffn_down.weight"),
    ("offset-past-eof", _offset("output_norm.weight", 1 << 40), "tensor output_norm.weight"),
    ("unaligned-offset", _offset("output_norm.weight", 3), "tensor output_norm.weight"),
    ("unknown-tensor-type", _unknown_tensor_type, "tensor output_norm.weight"),
    ("stray-layer", _stray_layer, "tensor blk.7.attn_norm.weight"),
    ("no-embedding", _no_embedding, "tensor token_embd.weight"),
    ("nan-rms-eps", _set("llama.attention.layer_norm_rms_epsilon", F32V, math.nan),
     "llama.attention.layer_norm_rms_epsilon"),
    ("inf-rope-theta", _set("llama.rope.freq_base", F32V, math.inf), "llama.rope.freq_base"),
    ("negative-rms-eps", _set("llama.attention.layer_norm_rms_epsilon", F32V, -1e-5),
     "llama.attention.layer_norm_rms_epsilon"),
    ("heads-as-text", _set("llama.attention.head_count", STR, "two"), "llama.attention.head_count"),
    ("kv-heads-above-heads", _set("llama.attention.head_count_kv", U32, 3), "llama.attention.head_count_kv"),
    ("huge-context", _set("llama.context_length", U64, 1 << 40), "llama.context_length"),
    ("unknown-value-type", _unknown_value_type, "general.mystery"),
    ("unknown-array-type", _unknown_array_type, "general.mystery"),
    ("arrays-nested-deep", _nested_too_deep, "general.deep"),
    ("tokens-not-strings", _set("tokenizer.ggml.tokens", ARR, (U32, [1, 2, 3, 4])), "tokenizer.ggml.tokens"),
    ("duplicate-key", _duplicate_key, "llama.block_count"),
    ("merge-without-space", _set("tokenizer.ggml.merges", ARR, (STR, ["ab"])), "tokenizer.ggml.merges"),
]

TOKENIZER_ONLY = {"200k-empty-strings-held", "tokens-not-strings", "merge-without-space"}


@dataclass(slots=True)
class Refusal:
    message: str
    peak_bytes: int


def refusal(read: Callable[[], Any]) -> Refusal:
    """The ``ValueError`` ``read`` raises and the peak memory Python allocated on the way."""
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as caught:
            read()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return Refusal(str(caught.value), peak)


def assert_one_line_naming(seen: Refusal, field_name: str) -> None:
    assert "\n" not in seen.message and len(seen.message) < 600, seen.message
    assert re.search(rf"{re.escape(field_name)}\b", seen.message), seen.message
    assert seen.peak_bytes < MEMORY_BOUND, f"{seen.peak_bytes / 2**20:.0f} MiB allocated: {seen.message}"


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_tiny_model_converts(tmp_path: Path, cache_dir: Path) -> None:
    """The writer is right: unbroken, the file converts (so each refusal below is its change's)."""
    out = resolve_model_dir(tiny_model().write(tmp_path / "tiny.gguf"))
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert check_supported(open_gguf(tmp_path / "tiny.gguf")).num_layers == 1


@pytest.mark.parametrize(("change", "field_name"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_a_hostile_file_is_one_line_naming_the_field(change: Callable[[TinyModel], None], field_name: str,
                                                      request: pytest.FixtureRequest, tmp_path: Path,
                                                      cache_dir: Path) -> None:  # fmt: skip
    model = tiny_model()
    change(model)
    path = model.write(tmp_path / "hostile.gguf")
    assert_one_line_naming(refusal(lambda: resolve_model_dir(path)), field_name)  # --model hostile.gguf
    if request.node.callspec.id in TOKENIZER_ONLY:  # the engine reads tensors, never the tokenizer's arrays
        check_supported(open_gguf(path))
    else:  # the engine's own read of the file (the quantized tensors it serves packed)
        assert_one_line_naming(refusal(lambda: check_supported(open_gguf(path))), field_name)
    assert not list(cache_dir.rglob("config.json"))  # nothing half-converted left behind


def test_a_big_endian_file_reads_as_the_little_endian_one(tmp_path: Path) -> None:
    """Big-endian files go through the same checked walk (no unchecked reader behind it)."""
    little = open_gguf(tiny_model().write(tmp_path / "le.gguf"))
    big = open_gguf(tiny_model().write(tmp_path / "be.gguf", order=">"))
    assert big.values == little.values and big.array("tokenizer.ggml.tokens") == little.array("tokenizer.ggml.tokens")
    assert [(t.name, t.shape.tolist()) for t in big.tensors] == [(t.name, t.shape.tolist()) for t in little.tensors]
    assert check_supported(big) == check_supported(little)
    model = tiny_model()
    model.meta["llama.attention.layer_norm_rms_epsilon"] = (F32V, math.nan)
    path = model.write(tmp_path / "be-nan.gguf", order=">")
    assert_one_line_naming(refusal(lambda: check_supported(open_gguf(path))), "llama.attention.layer_norm_rms_epsilon")


def test_a_huge_block_count_never_allocates_for_it(tmp_path: Path) -> None:
    model = tiny_model()
    model.meta["llama.block_count"] = (U32, (1 << 32) - 1)
    path = model.write(tmp_path / "layers.gguf")
    assert_one_line_naming(refusal(lambda: check_supported(open_gguf(path))), "llama.block_count")


def test_a_file_cut_anywhere_is_one_line(tmp_path: Path, cache_dir: Path) -> None:
    """Cut in the header, the key/value pairs, the tensor infos or the data: refused, one line."""
    whole = tiny_model().write(tmp_path / "whole.gguf").read_bytes()
    for cut in range(0, len(whole), 37):
        path = tmp_path / f"cut-{cut}.gguf"
        path.write_bytes(whole[:cut])
        seen = refusal(lambda: resolve_model_dir(path))  # noqa: B023 - called at once
        assert_one_line_naming(seen, "GGUF")
        assert re.search(r"not a GGUF file|truncated or corrupt GGUF header|past the end of the file", seen.message), (
            cut, seen.message)


def test_serve_prints_one_line_and_exits_non_zero(tmp_path: Path) -> None:
    """``inflight serve bad.gguf``: the field on the last line of stderr, no traceback."""
    env = {**os.environ, "INFLIGHT_CACHE_DIR": str(tmp_path / "cache")}
    cases = {"huge-tensor-count": (_huge_tensor_count, "header.tensor_count"),
             "nan-rms-eps": (_set("llama.attention.layer_norm_rms_epsilon", F32V, math.nan),
                             "llama.attention.layer_norm_rms_epsilon"),
             "4M-empty-strings": (_declared_array("tokenizer.ggml.tokens", STR, 4 << 20), "tokenizer.ggml.tokens")}
    for name, (change, field_name) in cases.items():
        model = tiny_model()
        change(model)
        path = model.write(tmp_path / f"{name}.gguf")
        done = subprocess.run([sys.executable, "-m", "inflight.runtime", "serve", str(path), "--port", "0"],
                              capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        lines = done.stderr.strip().splitlines()
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert lines[-1].startswith("inflight serve: error: ") and field_name in lines[-1], done.stderr
