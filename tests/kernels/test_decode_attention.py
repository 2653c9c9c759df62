"""Triton paged decode attention (flash-decoding) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (block_size, head_dim, num_heads, num_kv_heads, dtype, context_lens, forced split plan)
# Lengths cover 1, exact block boundaries, one past a boundary and ragged values; every value
# of each axis appears at least once, without the full cartesian product.
CASES = [
    (16, 64, 4, 4, F32, [1, 16, 33, 7], None),
    (32, 128, 8, 2, BF16, [32, 1, 64, 45], None),
    (16, 128, 8, 1, F16, [17, 48, 5], None),
    (32, 64, 8, 1, F32, [1, 96, 64, 33], (3, 16)),
    (16, 64, 8, 2, BF16, [80, 16, 1], (4, 16)),
    (32, 128, 4, 4, F16, [65, 2, 32], (2, 32)),
    (16, 80, 4, 2, F32, [5, 33], None),  # head_dim not a power of two: masked features
]


def _ids(case: tuple) -> str:
    bs, d, h, hkv, dtype, lens, split = case
    return f"bs{bs}-d{d}-gqa{h // hkv}-{str(dtype)[6:]}-split{split[0] if split else 'auto'}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_decode_matches_reference(
    case, device, make_paged_cache, poison_allocations, assert_close
) -> None:
    from inflight.kernels.triton_decode_attention import (
        decode_with_plan,
        paged_decode_attention,
        split_plan,
    )

    block_size, head_dim, num_heads, num_kv_heads, dtype, lens, split = case
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, dtype, device)
    gen = torch.Generator().manual_seed(len(lens) + head_dim)
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    args = (
        query,
        paged.k_cache,
        paged.v_cache,
        paged.block_tables,
        paged.context_lens,
        head_dim**-0.5,
    )
    expected = reference.paged_decode_attention(*args)
    if split is None:
        got = paged_decode_attention(*args)
    else:
        max_context = paged.block_tables.shape[1] * block_size
        got = decode_with_plan(*args, split_plan(max_context, split[0], split[1]))
    assert_close(got, expected)


def test_decode_auto_split_with_empty_splits(
    device, make_paged_cache, poison_allocations, assert_close
) -> None:
    """A wide block table makes the planner split; the short sequence leaves splits empty."""
    from inflight.kernels.triton_decode_attention import paged_decode_attention, plan_decode

    paged = make_paged_cache([300, 20], 16, 2, 64, F32, device)
    pad = torch.randint(0, paged.k_cache.shape[0], (2, 40 - paged.block_tables.shape[1]))
    tables = torch.cat([paged.block_tables, pad.int().to(device)], dim=1)  # [2, 40]
    assert plan_decode(2, 2, 40 * 16, 64, sms=4).num_splits > 1
    query = torch.randn(2, 4, 64).to(device)
    args = (query, paged.k_cache, paged.v_cache, tables, paged.context_lens, 0.125)
    assert_close(paged_decode_attention(*args), reference.paged_decode_attention(*args))


def test_decode_empty_batch(device) -> None:
    from inflight.kernels.triton_decode_attention import paged_decode_attention

    cache = torch.randn(2, 16, 1, 64, device=device)
    query = torch.randn(0, 2, 64, device=device)
    tables = torch.zeros(0, 1, dtype=torch.int32, device=device)
    lens = torch.zeros(0, dtype=torch.int32, device=device)
    assert paged_decode_attention(query, cache, cache, tables, lens, 0.1).shape == (0, 2, 64)


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "max_context", "sms"),
    [
        (1, 8, 32768, 132),
        (256, 8, 32768, 132),
        (32, 8, 2048, 132),
        (4, 2, 100, 132),
        (3, 1, 5000, 7),
    ],
)
def test_plan_decode_covers_context(num_seqs, num_kv_heads, max_context, sms) -> None:
    from inflight.kernels.triton_decode_attention import MAX_SPLITS, plan_decode

    plan = plan_decode(num_seqs, num_kv_heads, max_context, 128, sms)
    assert 1 <= plan.num_splits <= MAX_SPLITS
    assert plan.split_size % plan.block_n == 0
    assert (
        plan.num_splits * plan.split_size >= max_context > (plan.num_splits - 1) * plan.split_size
    )
    if num_seqs * num_kv_heads >= 4 * sms:  # enough programs already: no split
        assert plan.num_splits == 1


def test_plan_decode_splits_small_batches_long_contexts() -> None:
    from inflight.kernels.triton_decode_attention import plan_decode

    assert plan_decode(1, 8, 32768, 128, 132).num_splits >= 32
    assert plan_decode(1, 8, 128, 128, 132).num_splits == 1


def test_decode_rejects_bad_shapes(device) -> None:
    from inflight.kernels.triton_decode_attention import paged_decode_attention

    cache = torch.randn(4, 16, 3, 64, device=device)
    tables = torch.zeros(2, 2, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(
            torch.randn(2, 4, 64, device=device), cache, cache, tables, lens, 0.1
        )
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(
            torch.randn(2, 3, 32, device=device), cache, cache, tables, lens, 0.1
        )
    with pytest.raises(ValueError, match="row per sequence"):
        paged_decode_attention(
            torch.randn(3, 3, 64, device=device), cache, cache, tables, lens, 0.1
        )
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention(
            torch.randn(2, 3, 64, device=device), cache, cache, tables.float(), lens, 0.1
        )
