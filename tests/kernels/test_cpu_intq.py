"""compressed-tensors pack-quantized linears: the torch reference vs the package's own
decompression, the native C kernels vs the reference."""

from __future__ import annotations

from functools import cache

import pytest
import torch

from inflight.kernels import cpu_intq, intq_reference
from inflight.kernels.dispatch import TORCH_OPS, packed_linear_backend, with_quantized_linear
from inflight.kernels.intq_reference import IntQuantWeight, unpack_zero_point

pytest.importorskip("compressed_tensors")


@cache  # each weight is built once; no test changes one
def _packed(num_bits: int, out_features: int, in_features: int, group_size: int | None, symmetric: bool,
            scale_dtype: torch.dtype, seed: int = 0) -> tuple[IntQuantWeight, torch.Tensor]:
    """A random weight compressed by compressed-tensors itself; ours and its decompression."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=num_bits, type="int", symmetric=symmetric,
                            strategy="group" if group_size else "channel", group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.05
    group = group_size or in_features
    grouped = weight.unflatten(-1, (in_features // group, group))
    scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    state = {"weight": weight, "weight_scale": scale.to(scale_dtype), "weight_zero_point": zero_point}
    compressed = PackedQuantizationCompressor.compress(state, scheme)
    expected = PackedQuantizationCompressor.decompress(compressed, scheme)["weight"]
    zp = compressed.get("weight_zero_point")
    ours = IntQuantWeight(compressed["weight_packed"], compressed["weight_scale"], in_features, num_bits, group,
                          None if zp is None else unpack_zero_point(zp, num_bits, out_features))
    return ours, expected


CASES = [  # bits, out, in, group (None: channel), symmetric, scale dtype
    (4, 24, 96, 32, True, torch.float32),
    (4, 37, 128, 64, False, torch.bfloat16),
    (4, 20, 40, 8, False, torch.float16),
    (4, 33, 36, None, True, torch.float16),  # in_features not a multiple of 8: a partial last word
    (8, 24, 96, None, True, torch.float32),
    (8, 19, 64, 32, False, torch.bfloat16),
    (8, 16, 44, None, False, torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"int{c[0]}-{c[1]}x{c[2]}-g{c[3]}-{'sym' if c[4] else 'asym'}")
def test_reference_dequantizes_exactly_as_compressed_tensors(case: tuple) -> None:
    weight, expected = _packed(*case)
    assert weight.symmetric == case[4]
    got = intq_reference.dequantize(weight)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"int{c[0]}-{c[1]}x{c[2]}-g{c[3]}")
def test_native_dequantize_is_bit_identical(case: tuple, poison_allocations: None) -> None:
    _native()
    weight, expected = _packed(*case, seed=1)
    assert torch.equal(cpu_intq.dequantize_rows(weight, 0, weight.shape[0]), expected.float())
    assert torch.equal(cpu_intq.dequantize_rows(weight, 3, 11), expected.float()[3:11])


def _native() -> None:
    lib, why = cpu_intq.load_library()
    if lib is None:
        pytest.skip(f"no native build: {why}")


@pytest.mark.parametrize("case", [*CASES, (4, 264, 64, 32, False, torch.float32)],
                         ids=lambda c: f"int{c[0]}-{c[1]}x{c[2]}-g{c[3]}")
def test_native_linear_matches_reference(case: tuple, poison_allocations: None) -> None:
    _native()
    weight, _ = _packed(*case)
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(weight.shape[0], generator=gen)
    for num_rows in (*range(1, 10), 37):  # 1-8: the packed decode kernel (rows 4 at a time); more: tiles + GEMM
        x = torch.randn(num_rows, weight.in_features, generator=gen)
        for b in (None, bias):
            expected = intq_reference.intq_linear(x, weight, b)
            torch.testing.assert_close(cpu_intq.intq_linear(x, weight, b), expected, rtol=1e-5, atol=1e-5)


def test_other_inputs_go_to_the_reference() -> None:
    weight, _ = _packed(4, 16, 64, 32, True, torch.float32)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu_intq.intq_linear(x, weight), intq_reference.intq_linear(x, weight))
    x3 = torch.randn(2, 3, 64)
    assert cpu_intq.intq_linear(x3, weight).shape == (2, 3, 16)


def test_dispatch_routes_int_quant_weights_and_leaves_float_ones() -> None:
    weight, expected = _packed(8, 32, 64, None, False, torch.float16)
    x = torch.randn(2, 64)
    ops = with_quantized_linear(TORCH_OPS)
    torch.testing.assert_close(ops.linear(x, weight), x @ expected.float().t(), rtol=1e-5, atol=1e-5)
    dense = torch.randn(16, 64)
    assert torch.equal(ops.linear(x, dense), TORCH_OPS.linear(x, dense))
    assert packed_linear_backend("torch", weight, torch.device("cpu")) == "torch"
    assert packed_linear_backend("cpu", weight, torch.device("cpu")) == "cpu"


def test_bad_tensors_are_refused() -> None:
    packed, scale = torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, 2)
    IntQuantWeight(packed, scale, 64, 4, 32)  # the right shapes
    with pytest.raises(ValueError, match="num_bits must be 4 or 8"):
        IntQuantWeight(packed, scale, 64, 3, 32)
    with pytest.raises(ValueError, match="group_size 24 must divide"):
        IntQuantWeight(packed, scale, 64, 4, 24)
    with pytest.raises(ValueError, match=r"int32 \[out, 16\]"):
        IntQuantWeight(packed, scale, 64, 8, 32)
    with pytest.raises(ValueError, match="weight_scale"):
        IntQuantWeight(packed, torch.ones(4, 2, dtype=torch.float64), 64, 4, 32)
    with pytest.raises(ValueError, match="unpack_zero_point"):
        IntQuantWeight(packed, scale, 64, 4, 32, torch.zeros(1, 2, dtype=torch.int32))
