"""The Triton GGUF linear (CUDA, else Triton's interpreter) against the dequantize-then-matmul
reference, for Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K.

Blocks are random bytes with sane fp16 scales (every nibble and int8 value occurs). Shapes
that matter: 1..9 rows and a many-row tile, out_features not a multiple of BLOCK_N,
in_features not a multiple of a K split, an uneven and an empty K split, bias or not.

Tolerances: fp32 is the conftest's 1e-4 (same fp32 weights, only the summation order
differs: ~1e-6 relative at these K <= 288). bf16: both sides round every weight and the
output to bf16, but the interpreter rounds toward zero where torch rounds to nearest, so each
weight may differ by one ulp (<= 2^-7 of it) and each output by one ulp either side: the bound
is ``2^-7 * sum_k |x_k w_k| + 2^-6 * |expected|`` (a misread nibble or scale is far outside it).
"""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import quant_reference
from inflight.kernels.quant_reference import BLOCK_BYTES, BLOCK_WEIGHTS, QuantizedWeight

F32, BF16 = torch.float32, torch.bfloat16
QTYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _weight(qtype: str, out_features: int, in_features: int, seed: int, device: torch.device | str = "cpu") -> QuantizedWeight:
    """Random quants and sub-block scales; the fp16 scales (and mins) set to small values."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = in_features // BLOCK_WEIGHTS[qtype]
    blocks = torch.randint(0, 256, (out_features, num_blocks, BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=gen)
    small = 0.001 if qtype in K_QUANTS else 0.01  # the K-quants multiply by 6-bit or int8 scales
    for at in HALVES[qtype]:
        half = (torch.rand(out_features, num_blocks, 1, generator=gen) * small + small / 10).half()
        if qtype == "Q4_1" and at == 2:
            half -= 0.08  # Q4_1's min is usually negative
        blocks[..., at : at + 2] = half.view(torch.uint8)
    return QuantizedWeight(qtype, blocks.reshape(out_features, -1).to(device), in_features)


def _inputs(qtype: str, num_rows: int, out_features: int, in_features: int, dtype: torch.dtype,
            device: torch.device | str):  # fmt: skip
    weight = _weight(qtype, out_features, in_features, num_rows * 3 + in_features, device)
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, in_features, generator=gen).to(dtype).to(device)
    bias = torch.randn(out_features, generator=gen).to(device)  # fp32: the wrapper casts like the reference
    return x, weight, bias


def _check(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
           assert_close) -> None:  # fmt: skip
    expected = quant_reference.quant_linear(x, weight, bias)
    if x.dtype != BF16:
        assert_close(got, expected)
        return
    assert got.dtype == BF16 and got.shape == expected.shape
    spread = x.float().abs() @ quant_reference.dequantize(weight).abs().T  # [rows, out]
    bound = 2**-7 * spread + 2**-6 * expected.float().abs()
    assert bool(((got.float() - expected.float()).abs() <= bound).all()), (got - expected).abs().max()


def test_signature_matches_reference() -> None:
    import inspect

    pytest.importorskip("triton")
    from inflight.kernels import triton_quant

    assert inspect.signature(triton_quant.quant_linear) == inspect.signature(quant_reference.quant_linear)


def test_dispatch_wires_the_kernel_for_gguf_weights() -> None:
    pytest.importorskip("triton")
    from inflight.kernels import triton_quant
    from inflight.kernels.dispatch import packed_linear_backend, packed_linear_kernels

    assert packed_linear_kernels()[QuantizedWeight][2] is triton_quant.quant_linear
    weight = _weight("Q8_0", 2, 32, seed=0)
    assert packed_linear_backend("triton", weight, torch.device("cuda")) == "triton"
    assert packed_linear_backend("triton", weight, torch.device("cpu")) == "cpu"


def test_plan_depends_on_shapes_only() -> None:
    pytest.importorskip("triton")
    from inflight.kernels.triton_quant import QuantPlan, plan_quant_linear

    decode = plan_quant_linear(1, 4096, 4096, sms=132)
    assert (decode.block_m, decode.split_k) == (16, 3)  # 128 tiles of 32 features, cdiv(264, 128)
    assert plan_quant_linear(1, 64, 64, sms=132).split_k == 1  # 2 blocks of K: no split
    assert plan_quant_linear(64, 4096, 4096, sms=132).split_k == 3  # batch-64 decode: split too
    assert plan_quant_linear(65, 4096, 4096, sms=132) == QuantPlan(block_m=64, block_n=64, split_k=1)


@pytest.mark.parametrize("qtype", QTYPES)
def test_few_rows_match_reference(qtype: str, device, poison_allocations, assert_close) -> None:
    """1..9 rows (K-quants: 1, 4, 9), the decode path: in the interpreter's 4-SM stand-in, 2
    tiles of 40 features and 8 blocks of K give a 2-way split; with and without bias."""
    from inflight.kernels.triton_quant import plan_quant_linear, quant_linear

    assert plan_quant_linear(1, 40, 256, sms=4).split_k == 2
    for num_rows in (1, 4, 9) if qtype in K_QUANTS else range(1, 10):  # K-quants: fewer (time)
        x, weight, bias = _inputs(qtype, num_rows, 40, 256, F32, device)
        b = bias if num_rows % 2 else None
        _check(quant_linear(x, weight, b), x, weight, b, assert_close)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("num_rows", "dtype"), [(37, F32), (70, F32), (70, BF16)])
def test_many_rows_match_reference(qtype: str, num_rows: int, dtype: torch.dtype, device, poison_allocations,
                                   assert_close) -> None:  # fmt: skip
    """37 rows (BLOCK_M 64, split-K where K has 8 blocks) and 70 rows (two BLOCK_M 64 tiles,
    the second mostly masked, BLOCK_N 64 over 70 features, no split)."""
    from inflight.kernels.triton_quant import quant_linear

    x, weight, bias = _inputs(qtype, num_rows, 70, 256 if qtype in K_QUANTS else 96, dtype, device)
    _check(quant_linear(x, weight, bias), x, weight, bias, assert_close)


@pytest.mark.parametrize(("qtype", "in_features", "split_k"), [("Q4_1", 288, 3), ("Q4_1", 288, 4), ("Q5_K", 256, 3), ("Q6_K", 256, 5)])
def test_uneven_and_empty_k_splits(qtype: str, in_features: int, split_k: int, device, poison_allocations,
                                   assert_close) -> None:  # fmt: skip
    """9 blocks of K in 3 splits of 3 and in 4 splits of 3 (the last one empty); 8 sub-blocks
    of K-quant super-blocks in splits of 3, 3, 2 and of 2, 2, 2, 2, 0; bf16."""
    from inflight.kernels.triton_quant import QuantPlan, _launch

    x, weight, bias = _inputs(qtype, 5, 33, in_features, BF16, device)
    got = _launch(x, weight, bias, QuantPlan(block_m=16, block_n=32, split_k=split_k))
    _check(got, x, weight, bias, assert_close)


def test_empty_inputs(device) -> None:
    from inflight.kernels.triton_quant import quant_linear

    x, weight, bias = _inputs("Q8_0", 0, 8, 64, F32, device)
    assert quant_linear(x, weight, bias).shape == (0, 8)
    with pytest.raises(ValueError, match="features"):
        quant_linear(torch.zeros(2, 32, device=device), weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 16, 300])
def test_cuda_launches_without_a_host_sync(num_rows: int) -> None:
    """Launch sizes come from shapes, so a decode step can be captured in a CUDA graph; a
    Llama-sized projection also checks both paths at realistic K against the reference."""
    from inflight.kernels.triton_quant import quant_linear

    for qtype in QTYPES:
        x, weight, bias = _inputs(qtype, num_rows, 1000, 2048, BF16, "cuda")
        expected = quant_reference.quant_linear(x, weight, bias)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = quant_linear(x, weight, bias)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
