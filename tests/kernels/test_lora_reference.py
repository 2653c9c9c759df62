"""The multi-LoRA delta's torch reference (the CPU path) against a naive per-row loop.

Shapes that matter: several slots in one batch, rows with no adapter (-1), an ``out`` that is a
column slice of a wider tensor, bf16 and fp32, a rank padded with zeros, an empty batch and a
batch with no adapter at all.
"""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import lora_reference
from inflight.kernels.ops import TORCH_OPS

F32, BF16 = torch.float32, torch.bfloat16


def make_inputs(
    slots: list[int], num_slots: int, rank: int, in_features: int, out_features: int, dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, a, b, token_slots, out) with random values and every B non-zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), in_features, generator=gen).to(dtype)
    a = (torch.randn(num_slots, rank, in_features, generator=gen) * in_features**-0.5).to(dtype)
    b = (torch.randn(num_slots, out_features, rank, generator=gen) * rank**-0.5).to(dtype)
    out = torch.randn(len(slots), out_features, generator=gen).to(dtype)
    return x, a, b, torch.tensor(slots, dtype=torch.int32), out


def naive(x, a, b, token_slots, out) -> torch.Tensor:
    """One row at a time, in float64; a new tensor (``out`` is not touched)."""
    got = out.double().clone()
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            got[t] += b[s].double() @ (a[s].double() @ x[t].double())
    return got


TOL = {F32: {"atol": 1e-5, "rtol": 1e-5}, BF16: {"atol": 2e-2, "rtol": 2e-2}}
SLOTS = [2, 0, -1, 2, 1, 1, -1, 3, 0, 2, 2]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_several_slots_and_unadapted_rows(dtype: torch.dtype) -> None:
    x, a, b, slots, out = make_inputs(SLOTS, 4, 8, 48, 40, dtype)
    before = out.clone()
    expected = naive(x, a, b, slots, out)
    lora_reference.lora_delta(x, a, b, slots, out)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    unadapted = slots == -1
    assert torch.equal(out[unadapted], before[unadapted])  # -1 rows exactly untouched
    assert not torch.equal(out[~unadapted], before[~unadapted])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_out_is_a_column_slice_of_a_wider_tensor(dtype: torch.dtype) -> None:
    x, a, b, slots, _ = make_inputs(SLOTS, 4, 8, 48, 24, dtype, seed=1)
    fused = torch.randn(len(SLOTS), 24 + 16 + 16).to(dtype)  # q | k | v of a fused qkv output
    before = fused.clone()
    q = fused[:, :24]
    k = fused[:, 24:40]
    assert not q.is_contiguous()
    expected_k = naive(x, a[:, :, :], b[:, :16], slots, k)
    lora_reference.lora_delta(x, a, b[:, :16], slots, k)  # a 16-wide B into the k columns
    torch.testing.assert_close(k.double(), expected_k, **TOL[dtype])
    assert torch.equal(fused[:, :24], before[:, :24]) and torch.equal(fused[:, 40:], before[:, 40:])
    expected_q = naive(x, a, b, slots, q)
    lora_reference.lora_delta(x, a, b, slots, q)
    torch.testing.assert_close(fused[:, :24].double(), expected_q, **TOL[dtype])


def test_strided_x_and_int64_slots() -> None:
    x, a, b, slots, out = make_inputs(SLOTS, 4, 8, 48, 40, F32, seed=2)
    wide = torch.randn(len(SLOTS), 96)
    wide[:, 8:56] = x
    expected = naive(x, a, b, slots, out)
    lora_reference.lora_delta(wide[:, 8:56], a, b, slots.long(), out)
    torch.testing.assert_close(out.double(), expected, **TOL[F32])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_rank_padded_with_zeros_gives_the_same_result(dtype: torch.dtype) -> None:
    x, a, b, slots, out = make_inputs(SLOTS, 4, 8, 48, 40, dtype, seed=3)
    a_pad = torch.zeros(4, 32, 48, dtype=dtype)
    b_pad = torch.zeros(4, 40, 32, dtype=dtype)
    a_pad[:, :8], b_pad[:, :, :8] = a, b
    padded = out.clone()
    lora_reference.lora_delta(x, a, b, slots, out)
    lora_reference.lora_delta(x, a_pad, b_pad, slots, padded)
    # zeros add nothing; the GEMM's blocking may change with the rank (last-bit differences on AMD EPYC's MKL)
    if dtype == F32:
        torch.testing.assert_close(padded, out, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(padded, out)


def test_one_slot_for_the_whole_batch() -> None:
    x, a, b, slots, out = make_inputs([1] * 9, 3, 4, 32, 16, F32, seed=4)
    expected = naive(x, a, b, slots, out)
    lora_reference.lora_delta(x, a, b, slots, out)
    torch.testing.assert_close(out.double(), expected, **TOL[F32])


def test_empty_batch_and_all_rows_unadapted_change_nothing() -> None:
    x, a, b, slots, out = make_inputs([], 4, 8, 48, 40, F32)
    lora_reference.lora_delta(x, a, b, slots, out)
    assert out.shape == (0, 40)
    x, a, b, slots, out = make_inputs([-1] * 5, 4, 8, 48, 40, BF16)
    before = out.clone()
    lora_reference.lora_delta(x, a, b, slots, out)
    assert torch.equal(out, before)


def test_the_torch_bundle_carries_the_reference() -> None:
    assert TORCH_OPS.lora_delta is lora_reference.lora_delta


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: {**t, "a": t["a"][:, :, :-1]}, "do not fit"),
        (lambda t: {**t, "b": t["b"][:, :, :-1]}, "do not fit"),
        (lambda t: {**t, "out": t["out"][:-1]}, "one row per token"),
        (lambda t: {**t, "token_slots": t["token_slots"].float()}, "int32 or int64"),
        (lambda t: {**t, "b": t["b"].double()}, "share one of"),
        (lambda t: {**t, "x": t["x"][None]}, "x must be"),
        (lambda t: {**t, "token_slots": torch.tensor([0, 4, -1], dtype=torch.int32)}, r"\[-1, 4\)"),
        (lambda t: {**t, "token_slots": torch.tensor([0, -2, -1], dtype=torch.int32)}, r"\[-1, 4\)"),
    ],
)
def test_malformed_inputs_are_value_errors(change, message: str) -> None:
    x, a, b, slots, out = make_inputs([0, 1, -1], 4, 8, 16, 12, F32)
    args = change({"x": x, "a": a, "b": b, "token_slots": slots, "out": out})
    with pytest.raises(ValueError, match=message):
        lora_reference.lora_delta(**args)
