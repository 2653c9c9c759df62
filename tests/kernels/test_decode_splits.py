"""Decode-attention splits cut from each row's real context on the device (graph mode).

The CUDA graphs' block table is as wide as ``max_model_len``, so the launch's split count can
only come from that width; each row then cuts its own visible context into
``min(num_splits, ceil(len / min_split_tokens))`` slices inside the kernel, the programs past
its splits return at once and the merge reads only its count. Against the torch reference in
the interpreter (on CUDA when present), at mixed context lengths in one launch, with the
workspace poisoned (a merge that read an unwritten split would turn NaN)."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import reference

F32, BF16 = torch.float32, torch.bfloat16


def _widen(table: torch.Tensor, width: int, num_blocks: int, seed: int) -> torch.Tensor:
    """The table padded to ``width`` blocks with random ids (as a graph's wide table is)."""
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, num_blocks, (table.shape[0], width - table.shape[1]), generator=gen)
    return torch.cat([table.cpu(), extra.int()], dim=1).to(table.device)


# (block_size, head_dim, num_heads, num_kv_heads, dtype, context_lens, max splits, min split, window, sinks)
CASES = [
    (16, 64, 4, 2, F32, [1, 31, 32, 33, 100, 257, 190, 64], 8, 32, None, False),
    (16, 64, 8, 1, BF16, [300, 5, 129, 64, 17], 4, 64, None, False),
    (32, 128, 4, 4, F32, [250, 1, 96, 161], 6, 32, 70, False),  # a window: splits over the visible part
    (16, 64, 4, 2, F32, [200, 3, 77, 140], 5, 32, 50, True),  # window and attention sinks
    (16, 64, 4, 1, F32, [400, 9], 64, 16, None, True),  # more splits allowed than any row uses
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_per_row_splits_match_the_reference(case, device, make_paged_cache, poison_allocations, assert_close):
    from inflight.kernels.triton_decode_attention import DecodePlan, decode_with_plan, row_splits

    block_size, head_dim, num_heads, num_kv_heads, dtype, lens, max_splits, min_split, window, with_sinks = case
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, dtype, device)
    width = 4 * paged.block_tables.shape[1]  # far wider than any row: the graphs' table
    tables = _widen(paged.block_tables, width, paged.k_cache.shape[0], seed=len(lens))
    gen = torch.Generator().manual_seed(head_dim + len(lens))
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    sinks = (torch.randn(num_heads, generator=gen) * 2).to(device) if with_sinks else None
    args = (query, paged.k_cache, paged.v_cache, tables, paged.context_lens, head_dim**-0.5)
    expected = reference.paged_decode_attention(*args, window, sinks)
    plan = DecodePlan(num_splits=max_splits, split_size=-(-width * block_size // max_splits), block_n=16,
                      min_split_tokens=min_split)  # fmt: skip
    got = decode_with_plan(*args, plan, window, sinks)
    assert_close(got, expected)
    counts = [row_splits(n, plan, window or 0)[0] for n in lens]
    assert len(set(counts)) > 1 and max(counts) > 1  # the rows really ran at different split counts


def test_one_plan_serves_every_context(device, make_paged_cache, poison_allocations, assert_close):
    """The plan depends on the table's width only: the same launch (a replayed graph) takes
    any mix of lengths, each row at its own split count."""
    from inflight.kernels.triton_decode_attention import paged_decode_attention, plan_decode

    block_size, head_dim, width = 16, 64, 40
    plans = set()
    for step, lens in enumerate(([5, 300, 40], [600, 1, 250], [17, 18, 19])):
        paged = make_paged_cache(lens, block_size, 2, head_dim, F32, device)
        tables = _widen(paged.block_tables, width, paged.k_cache.shape[0], seed=step)
        query = torch.randn(len(lens), 4, head_dim, generator=torch.Generator().manual_seed(step)).to(device)
        args = (query, paged.k_cache, paged.v_cache, tables, paged.context_lens, head_dim**-0.5)
        assert_close(paged_decode_attention(*args), reference.paged_decode_attention(*args))
        plans.add(plan_decode(len(lens), 2, width * block_size, head_dim, 4))
    assert len(plans) == 1 and next(iter(plans)).min_split_tokens > 0


def test_graph_width_rows_get_splits_from_their_own_context():
    """Batch 64 on 132 SMs with a 32k-token table: the plan allows 5 splits; a row of 2k tokens
    now runs in 5 (it ran in one slice of ~6.5k tokens), a short row in as few as it needs."""
    from inflight.kernels.triton_decode_attention import MIN_SPLIT_TOKENS, plan_decode, row_splits

    plan = plan_decode(64, 2, 32768, 128, 132)
    assert plan.num_splits == 5 and plan.split_size > 6000  # the width-sized slice
    assert row_splits(2048, plan) == (5, 448)
    assert row_splits(8192, plan)[0] == 5
    assert row_splits(MIN_SPLIT_TOKENS, plan) == (1, MIN_SPLIT_TOKENS)
    assert row_splits(1, plan) == (1, 64)
    assert row_splits(1000, plan, window=300) == (2, 192)  # a window: only the visible tokens
    for n in (1, 100, 255, 256, 257, 1000, 2048, 6000, 32768):
        splits, size = row_splits(n, plan)
        assert 1 <= splits <= plan.num_splits and splits * size >= n > (splits - 1) * size - plan.block_n


def test_no_split_plans_stay_direct():
    from inflight.kernels.triton_decode_attention import plan_decode

    plan = plan_decode(256, 8, 32768, 128, 132)  # programs enough without splitting
    assert plan.num_splits == 1 and plan.min_split_tokens == 0
