"""Converting a GGUF file (llama.cpp, Ollama) into a Hugging Face model directory.

Reads the file with :mod:`inflight.runtime.model.gguf_index` (every count checked against the
file before it is used; the hyperparameters by :mod:`gguf_info`) and writes a directory our
loader reads like any checkpoint: ``config.json``, ``generation_config.json``, the tokenizer files built by
:mod:`inflight.runtime.model.gguf_tokenizer`, safetensors shards (one per group of layers) of
the file's float tensors (F32/F16/BF16: norms and the like) and an index. The block-quantized
tensors are not copied: the index names them (``gguf_tensors``) and the loader reads them from
the file itself (the directory links to it as ``source.gguf``), packed or dequantized on the fly
(:func:`gguf_float_tensors`: ``gguf.quants`` to float32, llama.cpp's q/k row permutation
undone), so a 4 GB Q4_K_M file never becomes 30 GB of float32 on disk. The directory is written
under a temporary name and renamed when complete, so an interrupted conversion never looks
finished. A file that cannot be read is refused with one :class:`GGUFError` line, never a
traceback.

Knows the GGUF tensor and metadata names of the Llama family only; anything else is refused
with the list of what is supported. Knows nothing about serving or where files are cached.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from inflight.runtime.model.gguf_checks import GGUFError, int_in
from inflight.runtime.model.gguf_index import open_gguf
from inflight.runtime.model.gguf_info import (  # noqa: F401 - re-exported: the converter's vocabulary
    SUPPORTED_GGUF_ARCHITECTURES,
    GGUFModelInfo,
    check_supported,
    field_value,
    read_model_info,
    source_path,
    supported_quantization_types,
)
from inflight.runtime.model.gguf_link import link_source
from inflight.runtime.model.gguf_tokenizer import write_tokenizer

Progress = Callable[[str], None]

FLOAT_TYPES = ("F32", "F16", "BF16")  # written to safetensors; every other type stays in the file
LAYERS_PER_SHARD = 5

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IGNORED_TENSORS: tuple[str, ...] = ()


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (it interleaves each head's two rotary halves).

    llama.cpp stores ``w.reshape(h, 2, d/2, in).swapaxes(1, 2)``; this is the inverse.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The transformers name of a GGUF tensor, or ``None`` for one the model does not need."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name in _IGNORED_TENSORS:
        return None
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a Llama-architecture model.")


def dequantized(tensor: Any, info: GGUFModelInfo) -> torch.Tensor:
    """One GGUF tensor as float32 in transformers' layout (q/k rows un-permuted)."""
    from gguf.quants import dequantize

    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    array = array.reshape(shape)
    if tensor.name.endswith("attn_q.weight"):
        array = unpermute_rows(array, info.num_heads)
    elif tensor.name.endswith("attn_k.weight"):
        array = unpermute_rows(array, info.num_kv_heads)
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C", copy=True))


def _shard_of(gguf_name: str, num_shards: int) -> int:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return int(parts[1]) // LAYERS_PER_SHARD
    return 0 if gguf_name == "token_embd.weight" else num_shards - 1


def _shards(reader: Any, info: GGUFModelInfo) -> Iterator[tuple[int, int, list[Any]]]:
    """(shard index, shard count, GGUF tensors) per group of layers."""
    num_shards = -(-info.num_layers // LAYERS_PER_SHARD)
    groups: list[list[Any]] = [[] for _ in range(num_shards)]
    for tensor in reader.tensors:
        groups[_shard_of(tensor.name, num_shards)].append(tensor)
    for i, group in enumerate(groups):
        yield i, num_shards, group


def hf_config(reader: Any, info: GGUFModelInfo) -> dict[str, Any]:
    """The ``config.json`` contents for the converted directory."""
    bos = special_token_id(reader, "tokenizer.ggml.bos_token_id", info.vocab_size)
    eos = special_token_id(reader, "tokenizer.ggml.eos_token_id", info.vocab_size)
    return {
        "architectures": [SUPPORTED_GGUF_ARCHITECTURES[info.architecture]],
        "model_type": info.architecture,
        "vocab_size": info.vocab_size,
        "hidden_size": info.hidden_size,
        "intermediate_size": info.intermediate_size,
        "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "head_dim": info.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": info.max_position_embeddings,
        "rms_norm_eps": info.rms_norm_eps,
        "rope_theta": info.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": info.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: Progress | None = None) -> Path:
    """Convert ``gguf_path`` into a Hugging Face directory at ``out_dir`` and return it
    (``ValueError``, one line, for a file that cannot be converted)."""
    gguf_path = Path(gguf_path)
    try:
        return _convert(gguf_path, Path(out_dir), progress or (lambda _msg: None))
    except (ArithmeticError, LookupError, TypeError, RecursionError) as exc:  # a case no check foresaw
        raise GGUFError(gguf_path, "file", f"cannot be converted ({type(exc).__name__}: {exc})") from exc


def _convert(gguf_path: Path, out_dir: Path, say: Progress) -> Path:
    reader = open_gguf(gguf_path)
    info = check_supported(reader)
    tmp = out_dir.with_name(out_dir.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        say(f"converting {gguf_path.name}: {info.architecture}, {info.num_layers} layers, "
            f"hidden {info.hidden_size}, vocab {info.vocab_size}")
        write_tokenizer(reader, tmp, info.vocab_size)
        say("converting: tokenizer written (tokenizer.json, chat template)")
        config = hf_config(reader, info)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_generation_config(config, tmp)
        weight_map, in_gguf = _write_weights(reader, info, tmp, say)
        link_source(tmp, gguf_path.resolve())  # the quantized tensors are read from the file
        index = {"metadata": {"source": gguf_path.name}, "weight_map": weight_map, "gguf_tensors": in_gguf}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"converted {gguf_path.name} -> {out_dir}")
    return out_dir


def special_token_id(reader: Any, key: str, vocab_size: int) -> int | None:
    """A special token id from the header; ``None`` when absent or outside the vocabulary (as
    llama.cpp, which falls back to its default), ``GGUFError`` when not an integer."""
    value = field_value(reader, key)
    if value is None:
        return None
    token_id = int_in(source_path(reader), key, value, -(1 << 63), (1 << 64) - 1)
    return token_id if 0 <= token_id < vocab_size else None


def _write_weights(reader: Any, info: GGUFModelInfo, out: Path, say: Progress) -> tuple[dict[str, str], dict[str, str]]:
    """The float tensors into safetensors shards; returns (weight map, quantized hf name -> GGUF name)."""
    weight_map: dict[str, str] = {}
    in_gguf: dict[str, str] = {}
    for i, num_shards, group in _shards(reader, info):
        name = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for tensor in group:
            hf_name = hf_tensor_name(tensor.name)
            if hf_name is None:
                continue
            if tensor.tensor_type.name in FLOAT_TYPES:
                tensors[hf_name] = dequantized(tensor, info)
            else:
                in_gguf[hf_name] = tensor.name
        if tensors:
            save_file(tensors, str(out / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
        first = i * LAYERS_PER_SHARD
        last = min(first + LAYERS_PER_SHARD, info.num_layers) - 1
        say(f"converting: layers {first}-{last}: {len(tensors)} float tensors written, "
            f"{len(group) - len(tensors)} quantized ones left in the file")
    return weight_map, in_gguf


class _GGUFFile:
    """A GGUF file opened on first use: a loader that serves every quantized tensor packed
    (installed before loading) never reads the file here a second time."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @cached_property
    def tensors(self) -> tuple[GGUFModelInfo, dict[str, Any]]:
        reader = open_gguf(self.path)
        return check_supported(reader), {t.name: t for t in reader.tensors}

    def tensor(self, gguf_name: str) -> tuple[Any, GGUFModelInfo]:
        info, by_name = self.tensors
        if gguf_name not in by_name:
            raise ValueError(f"{self.path} has no tensor {gguf_name!r}; the converted directory was made "
                             "from another file: delete it to convert again.")
        return by_name[gguf_name], info


class GGUFTensorPart:
    """A GGUF tensor read like a safetensors slice (``part[:]``, ``part[a:b]``,
    ``get_shape()``): dequantized to float32 in transformers' layout on first access."""

    def __init__(self, file: _GGUFFile, gguf_name: str) -> None:
        self._file, self._name = file, gguf_name
        self._value: torch.Tensor | None = None

    def get_shape(self) -> list[int]:
        return [int(d) for d in reversed(self._file.tensor(self._name)[0].shape)]

    def __getitem__(self, index: Any) -> torch.Tensor:
        if self._value is None:
            self._value = dequantized(*self._file.tensor(self._name))
        return self._value[index]


def gguf_float_tensors(gguf_path: str | Path, names: dict[str, str]) -> Iterator[tuple[str, GGUFTensorPart]]:
    """``(hf name, lazily dequantized part)`` for the quantized tensors a converted directory
    left in its GGUF file (``names``: hf name -> GGUF name, from the index); the file is opened
    only when a part is read."""
    file = _GGUFFile(Path(gguf_path))
    for hf_name, gguf_name in names.items():
        yield hf_name, GGUFTensorPart(file, gguf_name)


def _write_generation_config(config: dict[str, Any], out: Path) -> None:
    gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
