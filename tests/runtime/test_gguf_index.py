"""``gguf_index.open_gguf`` against the ``gguf`` package's own ``GGUFReader`` on the same files:
the same tensors (names, types, shapes, dtypes, offsets, bytes), the same scalar and string
metadata, arrays (the tokenizer's) left out; a custom alignment, a truncated file refused with
a ``ValueError``; the Q8_0 demo model dequantizes the same through either."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from inflight.runtime.model.gguf_convert import check_supported, dequantized
from inflight.runtime.model.gguf_index import GGUFIndex, open_gguf
from tests.runtime.test_gguf_convert import demo_unscaled_rope, write_gguf  # noqa: F401 - the fixture

Q = gguf.GGMLQuantizationType


def _same_as_reader(path: Path) -> tuple[GGUFIndex, gguf.GGUFReader]:
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
    assert isinstance(ours, GGUFIndex)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert (a.data.shape, a.data.dtype) == (b.data.shape, b.data.dtype), a.name
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name
    arrays = {k for k, f in theirs.fields.items() if isinstance(f.contents(), list)}
    header = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}  # the reader's pseudo-fields
    assert set(ours.values) == set(theirs.fields) - arrays - header
    for key, value in ours.values.items():
        assert value == theirs.fields[key].contents(), key
    return ours, theirs


def test_every_kind_of_value_and_tensor_matches_the_reader(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int64("t.i64", -(2**40))
    w.add_float32("t.f32", 0.25)
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.flag", True)
    w.add_string("t.text", "naïve ✓")
    w.add_array("t.words", ["a", "bb", "", "ccc"])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5), dtype=np.float32))
    w.add_tensor("f16", rng.standard_normal(7).astype(np.float16))
    for qtype in (Q.Q8_0, Q.Q4_0):
        rows = rng.standard_normal((4, 256), dtype=np.float32)
        w.add_tensor(f"q.{qtype.name}", gguf.quants.quantize(rows, qtype), raw_dtype=qtype)
    k_blocks = gguf.quants.quant_shape_to_byte_shape((4, 512), Q.Q4_K)  # gguf cannot quantize K types
    w.add_tensor("q.Q4_K", rng.integers(0, 256, k_blocks, dtype=np.uint8), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, _ = _same_as_reader(path)
    assert ours.values["general.alignment"] == 64 and ours.data_offset % 64 == 0
    assert ours.values["t.text"] == "naïve ✓" and ours.values["t.flag"] is True
    assert "t.words" not in ours.values and "t.nested" not in ours.values


def test_the_demo_model_reads_and_dequantizes_the_same(demo_unscaled_rope: Path, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "demo-q8.gguf"
    write_gguf(demo_unscaled_rope, path, Q.Q8_0)  # with a tokenizer's token and merge arrays
    ours, theirs = _same_as_reader(path)
    info = check_supported(ours)
    assert info == check_supported(theirs)
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert dequantized(a, info).equal(dequantized(b, info)), a.name


def test_a_truncated_file_is_a_value_error(demo_unscaled_rope: Path, tmp_path: Path) -> None:  # noqa: F811
    whole = tmp_path / "whole.gguf"
    write_gguf(demo_unscaled_rope, whole, Q.F32)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:5000])  # inside the tokenizer's arrays
    with pytest.raises(ValueError, match="truncated or corrupt GGUF header"):
        open_gguf(cut)
    (tmp_path / "not.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        open_gguf(tmp_path / "not.gguf")
