"""The CPU bundle's multi-LoRA delta (:mod:`inflight.kernels.lora_cpu`, bound in
:mod:`inflight.kernels.cpu_native`) against a naive per-row loop, on each of its paths: the
one-call C kernel (few float32 rows), the runs of one slot (many rows, prompts together), and
the reference's grouped path (many rows, many runs)."""

from __future__ import annotations

import inspect

import pytest
import torch

from inflight.kernels import cpu_native, lora_cpu, lora_reference
from tests.kernels.test_lora_reference import TOL, make_inputs, naive

lora_delta = cpu_native.lora_delta

F32, BF16 = torch.float32, torch.bfloat16
MIXED = [2, 0, -1, 2, 1, 1, -1, 3, 0, 2, 2]


def _check(slots: list[int], dtype: torch.dtype, rank: int = 8, seed: int = 0) -> None:
    x, a, b, token_slots, out = make_inputs(slots, 4, rank, 48, 40, dtype, seed=seed)
    before = out.clone()
    expected = naive(x, a, b, token_slots, out)
    lora_delta(x, a, b, token_slots, out)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    unadapted = token_slots == -1
    assert torch.equal(out[unadapted], before[unadapted])


@pytest.mark.usefixtures("native_built")
@pytest.mark.parametrize("rank", [8, 16, 24])
def test_native_few_rows_match_a_per_row_loop(rank: int) -> None:
    _check(MIXED, F32, rank=rank, seed=rank)
    _check([3], F32, rank=rank)  # a single decode row


@pytest.mark.usefixtures("native_built")
def test_native_runs_when_the_batch_has_few_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    native = lora_cpu._native
    monkeypatch.setattr(lora_cpu, "_native", lambda *args: calls.append(1) or native(*args))
    _check(MIXED, F32)
    assert calls == [1]


@pytest.mark.usefixtures("native_built")
def test_native_column_slice_strided_x_and_int64_slots() -> None:
    x, a, b, slots, _ = make_inputs(MIXED, 4, 8, 48, 24, F32, seed=5)
    fused = torch.randn(len(MIXED), 24 + 16 + 16)  # q | k | v
    before = fused.clone()
    wide = torch.randn(len(MIXED), 96)
    wide[:, 8:56] = x
    expected = naive(x, a, b[:, :16], slots, fused[:, 24:40])
    lora_delta(wide[:, 8:56], a, b[:, :16].contiguous(), slots.long(), fused[:, 24:40])
    torch.testing.assert_close(fused[:, 24:40].double(), expected, **TOL[F32])
    assert torch.equal(fused[:, :24], before[:, :24]) and torch.equal(fused[:, 40:], before[:, 40:])


@pytest.mark.usefixtures("native_built")
def test_native_refuses_a_bad_slot_and_writes_nothing() -> None:
    x, a, b, slots, out = make_inputs([0, 1, 4], 4, 8, 16, 12, F32)
    before = out.clone()
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        lora_delta(x, a, b, slots, out)
    assert torch.equal(out, before)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_many_rows_in_runs_of_one_slot(dtype: torch.dtype) -> None:
    """Prompt chunks one after another (each its own slot or none) after a few decode rows."""
    slots = [1, -1, 0] + [2] * 150 + [-1] * 40 + [0] * 90 + [3] * 30 + [2] * 7
    assert len(slots) > lora_cpu.NATIVE_MAX_ROWS
    _check(slots, dtype, seed=11)


def test_many_rows_in_many_runs_take_the_grouped_path(monkeypatch: pytest.MonkeyPatch) -> None:
    slots = [(i % 5) - 1 for i in range(300)]  # 300 runs of one row
    called = []
    monkeypatch.setattr(lora_cpu, "_by_runs", lambda *args: called.append(1))
    _check(slots, F32, seed=12)
    assert not called


def test_bf16_few_rows_and_empty_and_unadapted_batches() -> None:
    _check(MIXED, BF16, seed=13)
    _check([], F32)
    _check([-1] * 7, F32)
    _check([-1] * 300, BF16)


def test_many_rows_refuse_a_bad_slot() -> None:
    x, a, b, slots, out = make_inputs([0] * 299 + [-2], 4, 8, 16, 12, F32)
    with pytest.raises(ValueError, match=r"\[-1, 4\)"):
        lora_delta(x, a, b, slots, out)


def test_the_native_bundle_carries_it_with_the_reference_signature() -> None:
    assert cpu_native.CPU_OPS.lora_delta is lora_delta
    assert inspect.signature(lora_delta) == inspect.signature(lora_reference.lora_delta)


def test_without_the_library_every_call_takes_the_torch_path() -> None:
    unbuilt = lora_cpu.bound_to(lambda *args: (None, "no compiler"))
    x, a, b, slots, out = make_inputs(MIXED, 4, 8, 48, 40, F32)
    expected = naive(x, a, b, slots, out)
    unbuilt(x, a, b, slots, out)
    torch.testing.assert_close(out.double(), expected, **TOL[F32])
