"""The Triton pack-quantized linear (CUDA, else Triton's interpreter) against the reference
``intq_reference.intq_linear``: int4 and int8, group 8/32/64/96/128 and channel-wise,
symmetric and with zero points, fp16/bf16/fp32 scales.

Weights are random ints packed here (the layout ``intq_reference.unpack_int32`` reads; the
kernel tests need no compressed-tensors package) with random scales. Shapes that matter:
1..9 rows and many-row tiles, odd out_features, in_features not a multiple of 8 (a partial
last word), group sizes a K step does not divide (scales gathered per weight), an uneven and
an empty K split, bias or not.

Tolerances: the dequantized weights are bit-identical to the reference's (every rounding
point is reproduced; ``test_weights_are_bit_identical`` multiplies by the identity, where one
product per output makes the output the weight itself). So fp32 is the conftest's 1e-4 (only
the summation order differs). bf16 activations: both sides round the fp32 sum once, torch to
nearest and the interpreter toward zero, so the outputs differ by at most one bf16 ulp of the
sum (<= 2^-7 of it) plus the summation-order difference (<= 2^-16 of ``sum_k |x_k w_k|`` at
these K): a misread nibble, group or zero point is far outside it.
"""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import intq_reference
from inflight.kernels.intq_reference import IntQuantWeight

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# bits, out_features, in_features, group_size (in_features: channel-wise), zero points, scale dtype
SCHEMES = [
    (4, 37, 256, 32, False, F16),
    (4, 37, 256, 64, True, BF16),
    (4, 21, 256, 128, False, BF16),
    (4, 24, 192, 96, True, F16),  # K step 32 divides the group, 64 does not
    (4, 20, 40, 8, True, F32),  # groups narrower than a step: scales gathered per weight
    (4, 33, 36, 36, True, F16),  # channel-wise, 36 int4 = 4.5 words: a partial last word
    (8, 19, 96, 96, False, F32),
    (8, 24, 64, 32, True, BF16),
    (8, 16, 44, 44, True, F16),
]
IDS = [f"int{b}-{o}x{i}-g{g}-{'asym' if z else 'sym'}-{str(s)[6:]}" for b, o, i, g, z, s in SCHEMES]


def _pack(q: torch.Tensor, num_bits: int) -> torch.Tensor:  # [rows, values] unsigned -> [rows, words] int32
    per_word = 32 // num_bits
    words = intq_reference.packed_words(q.shape[1], num_bits)
    padded = torch.zeros(q.shape[0], words * per_word, dtype=torch.int64)
    padded[:, : q.shape[1]] = q
    shifts = torch.arange(per_word) * num_bits
    packed = (padded.view(q.shape[0], words, per_word) << shifts).sum(-1)  # [rows, words] in [0, 2^32)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _weight(scheme: tuple, seed: int, device: torch.device | str = "cpu") -> IntQuantWeight:
    """Every value of the range occurs; scales near 0.01, zero points anywhere in range."""
    bits, out_features, in_features, group_size, zero, scale_dtype = scheme
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (out_features, in_features), generator=gen)
    num_groups = in_features // group_size
    scale = (torch.rand(out_features, num_groups, generator=gen) * 0.02 + 0.002).to(scale_dtype)
    half = 1 << (bits - 1)
    zp = torch.randint(-half, half, (out_features, num_groups), generator=gen).to(torch.int8) if zero else None
    return IntQuantWeight(_pack(q, bits).to(device), scale.to(device), in_features, bits, group_size,
                          None if zp is None else zp.to(device))


def _inputs(scheme: tuple, num_rows: int, dtype: torch.dtype, device: torch.device | str):
    weight = _weight(scheme, num_rows * 7 + scheme[2], device)
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, scheme[2], generator=gen).to(dtype).to(device)
    bias = torch.randn(scheme[1], generator=gen).to(device)  # fp32: the wrapper casts like the reference
    return x, weight, bias


def _check(got: torch.Tensor, x: torch.Tensor, weight: IntQuantWeight, bias: torch.Tensor | None,
           assert_close) -> None:  # fmt: skip
    expected = intq_reference.intq_linear(x, weight, bias)
    if x.dtype != BF16:
        assert_close(got, expected)
        return
    assert got.dtype == BF16 and got.shape == expected.shape
    spread = x.float().abs() @ intq_reference.dequantize(weight).float().abs().T  # [rows, out]
    bound = 2**-7 * expected.float().abs() + 2**-16 * spread
    assert bool(((got.float() - expected.float()).abs() <= bound).all()), (got - expected).abs().max()


def test_packing_matches_the_reference_layout() -> None:
    q = torch.randint(0, 16, (3, 36))
    assert torch.equal(intq_reference.unpack_int32(_pack(q, 4), 4, 36), (q - 8).to(torch.int8))
    q = torch.randint(0, 256, (3, 44))
    assert torch.equal(intq_reference.unpack_int32(_pack(q, 8), 8, 44), (q - 128).to(torch.int8))


def test_signature_matches_reference() -> None:
    import inspect

    pytest.importorskip("triton")
    from inflight.kernels import triton_intq

    assert inspect.signature(triton_intq.intq_linear) == inspect.signature(intq_reference.intq_linear)


def test_dispatch_wires_the_kernel_for_pack_quantized_weights() -> None:
    pytest.importorskip("triton")
    from inflight.kernels import triton_intq
    from inflight.kernels.dispatch import packed_linear_backend, packed_linear_kernels

    assert packed_linear_kernels()[IntQuantWeight][2] is triton_intq.intq_linear
    weight = _weight(SCHEMES[0], seed=0)
    assert packed_linear_backend("triton", weight, torch.device("cuda")) == "triton"
    assert packed_linear_backend("triton", weight, torch.device("cpu")) == "cpu"


def test_plan_depends_on_shapes_only() -> None:
    pytest.importorskip("triton")
    from inflight.kernels.triton_intq import IntQuantPlan, plan_intq_linear

    decode = plan_intq_linear(1, 4096, 4096, 128, sms=132)
    assert decode == IntQuantPlan(block_m=16, block_n=32, block_k=64, split_k=3)  # as the GGUF plan
    assert plan_intq_linear(1, 4096, 4096, 32, sms=132).block_k == 32
    assert plan_intq_linear(1, 4096, 4096, 4096, sms=132).block_k == 64  # channel-wise
    assert plan_intq_linear(1, 4096, 36, 36, sms=132).block_k == 64  # one group: any K
    assert plan_intq_linear(1, 64, 64, 8, sms=132).split_k == 1
    assert plan_intq_linear(65, 4096, 4096, 128, sms=132).split_k == 1


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_weights_are_bit_identical(scheme: tuple, dtype: torch.dtype, device, poison_allocations) -> None:
    """x = I: every output is one product ``1 * w`` (exact in fp32, and already representable in
    x's dtype), so the output is the kernel's weight, compared bit for bit with the reference's
    ``dequantize(weight).to(x.dtype)``: the scale-dtype rounding, the rounding to x's dtype
    (fp16 scales with bf16 x: both), zero points and the unpacking, in the many-row path."""
    from inflight.kernels.triton_intq import intq_linear

    weight = _weight(scheme, seed=1, device=device)
    eye = torch.eye(scheme[2], dtype=dtype, device=device)
    expected = intq_reference.dequantize(weight).to(dtype).T  # [in, out]
    assert torch.equal(intq_linear(eye, weight), expected)


@pytest.mark.parametrize("scheme", SCHEMES, ids=IDS)
def test_few_rows_match_reference(scheme: tuple, device, poison_allocations, assert_close) -> None:
    """1..9 rows, the decode path (in the interpreter's 4-SM stand-in, K = 256 is split in 2),
    fp32 activations, bias on odd row counts."""
    from inflight.kernels.triton_intq import intq_linear, plan_intq_linear

    assert plan_intq_linear(1, 37, 256, 32, sms=4).split_k == 2

    rows = range(1, 10) if scheme in SCHEMES[:2] else (1, 4, 9)  # all of 1..9 for two schemes (time)
    for num_rows in rows:
        x, weight, bias = _inputs(scheme, num_rows, F32, device)
        b = bias if num_rows % 2 else None
        _check(intq_linear(x, weight, b), x, weight, b, assert_close)


@pytest.mark.parametrize("scheme", [SCHEMES[1], SCHEMES[4], SCHEMES[5], SCHEMES[7]], ids=lambda s: f"int{s[0]}-g{s[3]}")
@pytest.mark.parametrize(("num_rows", "dtype"), [(37, F32), (70, BF16)])
def test_many_rows_match_reference(scheme: tuple, num_rows: int, dtype: torch.dtype, device, poison_allocations,
                                   assert_close) -> None:  # fmt: skip
    """37 rows (BLOCK_M 64, split K where there is enough of it) and 70 rows (two BLOCK_M 64
    tiles, the second mostly masked, BLOCK_N 64, no split), with bias."""
    from inflight.kernels.triton_intq import intq_linear

    x, weight, bias = _inputs(scheme, num_rows, dtype, device)
    _check(intq_linear(x, weight, bias), x, weight, bias, assert_close)


@pytest.mark.parametrize(("scheme", "split_k"), [(SCHEMES[3], 4), (SCHEMES[3], 5), (SCHEMES[2], 3)],
                         ids=["6-steps-in-3x2", "6-steps-in-4x2-last-empty", "4-steps-in-2-2-0"])
def test_uneven_and_empty_k_splits(scheme: tuple, split_k: int, device, poison_allocations,
                                   assert_close) -> None:  # fmt: skip
    """192 inputs in 32-steps (group 96): 6 steps in splits of 2, 2, 2 and of 2, 2, 2, 0; 256
    inputs in 64-steps: 4 steps in splits of 2, 2, 0. bf16 activations, bias."""
    from inflight.kernels.triton_intq import IntQuantPlan, _launch

    x, weight, bias = _inputs(scheme, 5, BF16, device)
    block_k = 32 if scheme[3] == 96 else 64
    got = _launch(x, weight, bias, IntQuantPlan(block_m=16, block_n=32, block_k=block_k, split_k=split_k))
    _check(got, x, weight, bias, assert_close)


def test_empty_inputs(device) -> None:
    from inflight.kernels.triton_intq import intq_linear

    x, weight, bias = _inputs(SCHEMES[0], 0, F32, device)
    assert intq_linear(x, weight, bias).shape == (0, 37)
    with pytest.raises(ValueError, match="features"):
        intq_linear(torch.zeros(2, 64, device=device), weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 16, 300])
def test_cuda_launches_without_a_host_sync(num_rows: int) -> None:
    """Launch sizes come from shapes, so a decode step can be captured in a CUDA graph; a
    Llama-sized projection also checks both paths at realistic K against the reference."""
    from inflight.kernels.triton_intq import intq_linear

    for bits, group, zero, scale_dtype in [(4, 128, False, F16), (4, 32, True, BF16), (8, 2048, False, BF16),
                                           (8, 128, True, F32)]:
        x, weight, bias = _inputs((bits, 1000, 2048, group, zero, scale_dtype), num_rows, BF16, "cuda")
        expected = intq_reference.intq_linear(x, weight, bias)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = intq_linear(x, weight, bias)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)
        eye = torch.eye(2048, dtype=BF16, device="cuda")
        assert torch.equal(intq_linear(eye, weight), intq_reference.dequantize(weight).to(BF16).T)
