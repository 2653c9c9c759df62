"""The fused mixture-of-experts MLP: the torch reference against a naive per-token loop, and
the Triton kernel (CUDA, else Triton's interpreter) against the reference.

Shapes that matter: top-k 1/2/4/8, 8 to 128 experts, uneven token counts per expert, experts
with no tokens, a single token (a decode step of one sequence) and no tokens at all.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.kernels import reference

F32, BF16 = torch.float32, torch.bfloat16

# (num_tokens, hidden, intermediate, num_experts, top_k, experts the router may pick or None: all)
CASES = [
    (1, 32, 16, 8, 1, None),
    (7, 32, 24, 8, 2, None),
    (33, 64, 32, 16, 4, None),
    (20, 32, 16, 128, 8, None),
    (40, 32, 16, 8, 2, [0, 3, 5]),  # most experts empty, the rest uneven
    (0, 32, 16, 8, 2, None),
]


def _ids(case: tuple) -> str:
    t, h, i, e, k, only = case
    return f"t{t}-h{h}-i{i}-e{e}-k{k}" + ("-sparse" if only else "")


def _inputs(case: tuple, dtype: torch.dtype, device: torch.device | str = "cpu"):
    num_tokens, hidden, width, num_experts, top_k, only = case
    gen = torch.Generator().manual_seed(num_tokens * 7 + num_experts + top_k)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * width, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, width, generator=gen) * width**-0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if only is not None:  # experts outside ``only`` are never picked
        logits[:, [e for e in range(num_experts) if e not in only]] = float("-inf")
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return (x.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device),
            weights.to(device), ids.to(device))  # fmt: skip


def _naive(x, w13, w2, weights, ids) -> torch.Tensor:
    """One token and one of its experts at a time, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    width = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double()
            act = F.silu(gate_up[:width]) * gate_up[width:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ act)
    return out


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_reference_matches_a_per_token_loop(case) -> None:
    x, w13, w2, weights, ids = _inputs(case, F32)
    got = reference.fused_moe(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == F32
    torch.testing.assert_close(got.double(), _naive(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_reference_takes_int32_ids_and_keeps_the_dtype() -> None:
    x, w13, w2, weights, ids = _inputs(CASES[1], BF16)
    got = reference.fused_moe(x, w13, w2, weights, ids.int())
    assert got.dtype == BF16
    torch.testing.assert_close(got, reference.fused_moe(x, w13, w2, weights, ids))


def test_align_pairs_groups_each_block_by_one_expert() -> None:
    pytest.importorskip("triton")
    from inflight.kernels.triton_moe import align_pairs

    _, _, _, _, ids = _inputs(CASES[4], F32)
    num_pairs, block_m = ids.numel(), 16
    sorted_pairs, block_expert = align_pairs(ids, 8, block_m)
    real = sorted_pairs[sorted_pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs)), "every pair exactly once"
    flat = ids.reshape(-1)
    for b, expert in enumerate(block_expert.tolist()):
        rows = sorted_pairs[b * block_m : (b + 1) * block_m]
        rows = rows[rows < num_pairs]
        if expert == 8:
            assert rows.numel() == 0, "a block past the end holds pairs"
        else:
            assert bool((flat[rows.long()] == expert).all()), f"block {b} mixes experts"
    assert set(block_expert.tolist()) <= {0, 3, 5, 8}


def test_bundles_share_the_reference_signature() -> None:
    import inspect

    from inflight.kernels.dispatch import TORCH_OPS

    assert TORCH_OPS.fused_moe is reference.fused_moe
    pytest.importorskip("triton")
    from inflight.kernels.triton_moe import fused_moe

    assert inspect.signature(fused_moe) == inspect.signature(reference.fused_moe)


# The Triton kernel: a few of the shapes above in both precisions (the interpreter is slow).
TRITON_CASES = [(CASES[0], F32), (CASES[2], F32), (CASES[3], BF16), (CASES[4], F32), (CASES[4], BF16), (CASES[5], F32)]


@pytest.mark.parametrize(("case", "dtype"), TRITON_CASES, ids=[f"{_ids(c)}-{str(d)[6:]}" for c, d in TRITON_CASES])
def test_triton_matches_reference(case, dtype, device, poison_allocations, assert_close) -> None:
    from inflight.kernels.triton_moe import fused_moe

    args = _inputs(case, dtype, device)
    expected = reference.fused_moe(*args)
    assert_close(fused_moe(*args), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_launches_without_a_host_sync() -> None:
    """Every launch size comes from shapes, so a decode step with an expert layer can be captured
    in a CUDA graph (the reference reads per-expert counts on the host and cannot)."""
    from inflight.kernels.triton_moe import fused_moe

    args = _inputs(CASES[3], BF16, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
