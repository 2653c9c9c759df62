"""The Triton multi-LoRA delta (CUDA, else Triton's interpreter) against the torch reference.

Sizes are small so the interpreter is quick; the cases cover several slots in one batch with
uneven groups (one larger than a block of rows), rows with no adapter, a rank below the tile,
a column-slice ``out``, a decode-sized batch, an empty batch and a batch with no adapter.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from inflight.kernels import lora_reference
from tests.kernels.test_lora_reference import make_inputs

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (slots per row, num_slots, rank, in_features, out_features)
CASES = {
    "mixed": ([2, 0, -1, 2, 1, 1, -1, 3, 0, 2, 2], 4, 8, 48, 40),
    "big-group": ([1] * 19 + [-1, 0, 1], 3, 16, 96, 70),  # one slot over a whole block of rows
    "decode": ([3], 4, 16, 64, 64),
    "rank-24": ([0, 1, 0, -1, 1], 2, 24, 40, 130),  # rank not a power of two, N over two tiles
    "long-k": ([1, -1, 0, 1], 2, 16, 600, 40),  # the shrink's K loop split (see the split test)
}


def _on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize(("name", "dtype"), [("mixed", F32), ("mixed", BF16), ("big-group", F32),
                                             ("decode", BF16), ("rank-24", F16), ("long-k", F32),
                                             ("long-k", BF16)])  # fmt: skip
def test_triton_matches_reference(name: str, dtype: torch.dtype, device, poison_allocations, assert_close) -> None:
    from inflight.kernels.triton_lora import lora_delta

    x, a, b, slots, out = _on(device, *make_inputs(*CASES[name], dtype, seed=len(name)))
    expected = out.clone()
    lora_reference.lora_delta(x, a, b, slots, expected)
    before = out.clone()
    lora_delta(x, a, b, slots, out)
    assert_close(out, expected)
    unadapted = slots == -1
    assert torch.equal(out[unadapted], before[unadapted])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
def test_triton_writes_a_column_slice_and_nothing_else(dtype: torch.dtype, device, assert_close) -> None:
    from inflight.kernels.triton_lora import lora_delta

    x, a, b, slots, _ = _on(device, *make_inputs(CASES["mixed"][0], 4, 8, 48, 24, dtype, seed=7))
    fused = torch.randn(len(slots), 24 + 16 + 16).to(dtype).to(device)  # q | k | v
    expected = fused.clone()
    lora_reference.lora_delta(x, a, b[:, :16], slots, expected[:, 24:40])
    lora_delta(x, a, b[:, :16], slots, fused[:, 24:40])
    assert torch.equal(fused[:, :24], expected[:, :24]) and torch.equal(fused[:, 40:], expected[:, 40:])
    assert_close(fused, expected)


def test_triton_strided_x_and_int64_slots(device, assert_close) -> None:
    from inflight.kernels.triton_lora import lora_delta

    x, a, b, slots, out = _on(device, *make_inputs(CASES["mixed"][0], 4, 8, 48, 40, F32, seed=8))
    wide = torch.randn(len(slots), 96, device=device)
    wide[:, 8:56] = x
    expected = out.clone()
    lora_reference.lora_delta(x, a, b, slots, expected)
    lora_delta(wide[:, 8:56], a, b, slots.long(), out)
    assert_close(out, expected)


def test_triton_empty_batch_and_no_adapter_change_nothing(device) -> None:
    from inflight.kernels.triton_lora import lora_delta

    x, a, b, slots, out = _on(device, *make_inputs([], 4, 8, 48, 40, F32))
    lora_delta(x, a, b, slots, out)
    x, a, b, slots, out = _on(device, *make_inputs([-1] * 5, 4, 8, 48, 40, BF16))
    before = out.clone()
    lora_delta(x, a, b, slots, out)
    assert torch.equal(out, before)


def test_triton_skips_out_of_range_slots_without_reading_them(device) -> None:
    """The kernel never reads the slots on the host, so it cannot refuse a bad one as the
    reference does: such a row is left alone (and no memory past ``a``/``b`` is read)."""
    from inflight.kernels.triton_lora import lora_delta

    x, a, b, slots, out = _on(device, *make_inputs([0, 9, -3, 1], 2, 8, 32, 16, F32))
    expected = out.clone()
    lora_reference.lora_delta(x, a, b, torch.tensor([0, -1, -1, 1], dtype=torch.int32, device=device), expected)
    lora_delta(x, a, b, slots, out)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_split_k_plan_comes_from_shapes() -> None:
    pytest.importorskip("triton")
    from inflight.kernels.triton_lora import MAX_SPLIT_K, plan_split_k

    assert plan_split_k(1, 600, 4) == 2  # the long-k case above: 10 steps of 64, few blocks
    assert plan_split_k(1, 4096, 132) == MAX_SPLIT_K  # a decode row of a 4096-wide model
    assert plan_split_k(2, 96, 132) == 1  # too short a K to split
    assert plan_split_k(600, 4096, 132) == 1  # a prefill fills the GPU with blocks of rows


def test_triton_refuses_malformed_inputs_before_launch() -> None:
    pytest.importorskip("triton")
    from inflight.kernels.triton_lora import lora_delta

    x, a, b, slots, out = make_inputs([0, 1], 2, 8, 32, 16, F32)
    with pytest.raises(ValueError, match="do not fit"):
        lora_delta(x, a, b[:, :, :4], slots, out)


def test_triton_bundle_carries_it_with_the_reference_signature() -> None:
    pytest.importorskip("triton")
    from inflight.kernels import triton_lora
    from inflight.kernels.triton_ops import TRITON_OPS

    assert TRITON_OPS.lora_delta is triton_lora.lora_delta
    assert inspect.signature(triton_lora.lora_delta) == inspect.signature(lora_reference.lora_delta)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_launches_without_a_host_sync() -> None:
    """Launch sizes come from shapes, so a decode step with adapters can be captured in a CUDA
    graph (the reference reads the slots on the host and cannot)."""
    from inflight.kernels.triton_lora import lora_delta

    x, a, b, slots, out = _on(torch.device("cuda"), *make_inputs(CASES["mixed"][0], 4, 16, 256, 512, BF16))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora_delta(x, a, b, slots, out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_replays_in_a_cuda_graph_with_new_slots(assert_close) -> None:
    """Captured once, replayed after the slots (and x) change in place: the grouping is redone
    on the device at every replay."""
    from inflight.kernels.triton_lora import lora_delta

    dev = torch.device("cuda")
    x, a, b, slots, out = _on(dev, *make_inputs(CASES["mixed"][0], 4, 16, 256, 512, BF16))
    static_out = out.clone()
    lora_delta(x, a, b, slots, static_out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_delta(x, a, b, slots, static_out)
    new_slots = torch.tensor([3, 3, 0, -1, -1, 1, 2, 2, 0, 1, 3], dtype=torch.int32, device=dev)
    slots.copy_(new_slots)
    static_out.copy_(out)
    graph.replay()
    expected = out.clone()
    lora_reference.lora_delta(x, a, b, new_slots, expected)
    assert_close(static_out, expected)


def test_gpu_bench_lora_table_and_its_report(device) -> None:
    """The GPU kernel bench's LoRA rows at toy sizes (a counting timer: nothing is timed here),
    and the report's section for them; no section without rows."""
    from bench.gpu.lora import LoraShape, lora_table
    from bench.gpu.report import _lora

    calls: list[int] = []

    def timer(fn) -> float:
        fn()
        calls.append(1)
        return 0.5

    shape = LoraShape(in_features=32, out_features=24, num_adapters=2, dtype=F32, device=device.type)
    rows = lora_table(shape, (1, 5), timer=timer)
    assert [r["num_tokens"] for r in rows] == [1, 5] and len(calls) == 6
    assert all(r["triton_ms"] == r["reference_ms"] == r["base_ms"] == 0.5 for r in rows)
    lines = _lora({"lora": rows + [{"num_tokens": 9, "error": "RuntimeError: x|y"}]})
    assert "| 1 | 500.0 | 500.0 | 500.0 | 1.00 |" in lines and any("FAILED: RuntimeError: x\\|y" in ln for ln in lines)
    assert _lora({}) == []
