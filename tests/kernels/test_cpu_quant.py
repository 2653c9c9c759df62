"""The GGUF block-quantized linear: torch reference vs gguf's own dequantize, C kernels vs reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inflight.kernels import cpu_quant, quant_reference
from inflight.kernels.dispatch import TORCH_OPS, with_quantized_linear
from inflight.kernels.quant_reference import QuantizedWeight

gguf_quants = pytest.importorskip("gguf.quants")
QTYPES = ("Q4_0", "Q4_1", "Q8_0")


def _packed(qtype: str, out_features: int, in_features: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    from gguf import GGMLQuantizationType

    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out_features, in_features)).astype(np.float32) * 0.1
    blocks = gguf_quants.quantize(w, GGMLQuantizationType[qtype])  # [out, row_bytes] uint8
    exact = gguf_quants.dequantize(blocks, GGMLQuantizationType[qtype]).astype(np.float32)
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks)), in_features), exact


def _native() -> None:
    lib, why = cpu_quant.load_library()
    if lib is None:
        pytest.skip(f"no native build: {why}")


@pytest.mark.parametrize("qtype", QTYPES)
def test_reference_dequantizes_exactly_as_gguf(qtype: str) -> None:
    weight, exact = _packed(qtype, 24, 96)
    assert torch.equal(quant_reference.dequantize(weight), torch.from_numpy(exact))
    ids = torch.tensor([3, 0, 23, 3])
    assert torch.equal(quant_reference.quant_embedding(ids, weight), torch.from_numpy(exact)[ids])


@pytest.mark.parametrize("qtype", QTYPES)
def test_native_dequantize_is_bit_identical(qtype: str) -> None:
    _native()
    weight, exact = _packed(qtype, 300, 576, seed=1)
    assert torch.equal(cpu_quant.dequantize_rows(weight, 0, 300), torch.from_numpy(exact))
    ids = torch.tensor([7, 299, 0])
    assert torch.equal(cpu_quant.quant_embedding(ids, weight), torch.from_numpy(exact)[ids])


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 4, 8, 9, 37])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 32), (300, 576), (576, 1536)])
@pytest.mark.parametrize("whole_weight_bytes", [cpu_quant.WHOLE_WEIGHT_BYTES, 0], ids=["whole", "tiles"])
def test_native_linear_matches_reference(qtype: str, num_rows: int, out_features: int, in_features: int,
                                         whole_weight_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _native()
    monkeypatch.setattr(cpu_quant, "WHOLE_WEIGHT_BYTES", whole_weight_bytes)  # 0: every many-row call by tiles
    weight, _ = _packed(qtype, out_features, in_features, seed=num_rows)
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    for b in (None, bias):
        expected = quant_reference.quant_linear(x, weight, b)
        got = cpu_quant.quant_linear(x, weight, b)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_dispatch_routes_quantized_weights_and_leaves_float_ones() -> None:
    weight, exact = _packed("Q4_1", 64, 128)
    x = torch.randn(2, 128)
    for ops in (with_quantized_linear(TORCH_OPS),):
        torch.testing.assert_close(ops.linear(x, weight), x @ torch.from_numpy(exact).t(), rtol=1e-5, atol=1e-5)
        dense = torch.randn(16, 128)
        assert torch.equal(ops.linear(x, dense), TORCH_OPS.linear(x, dense))


def test_bad_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="unsupported quantized type 'IQ2_XS'"):
        QuantizedWeight("IQ2_XS", torch.zeros(2, 10, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight("Q4_0", torch.zeros(2, 18, dtype=torch.uint8), 48)
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight("Q8_0", torch.zeros(2, 10, dtype=torch.uint8), 32)
