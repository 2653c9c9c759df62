"""Sliding-window attention: the reference against a dense masked softmax written out by hand,
and the native CPU decode kernel and the Triton decode/prefill kernels (Triton's interpreter on
the CPU) against the reference, with windows smaller and larger than the contexts.

The convention is transformers' (``kv_idx > q_idx - sliding_window``): the query at position
``p`` sees keys ``p - W + 1 .. p``, ``W`` keys including itself.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from inflight.kernels import reference
from tests.kernels.threads import with_threads

F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")


def _dense(query, paged, starts, window):  # [num_tokens, H, D]: a masked softmax, no paging tricks
    out = torch.empty_like(query, dtype=torch.float32)
    block_size, num_kv_heads = paged.k_cache.shape[1], paged.k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    for s, ctx in enumerate(paged.context_lens.tolist()):
        blocks = paged.block_tables[s, : -(-ctx // block_size)].long()
        keys = paged.k_cache[blocks].reshape(-1, num_kv_heads, query.shape[2])[:ctx].float()
        values = paged.v_cache[blocks].reshape(-1, num_kv_heads, query.shape[2])[:ctx].float()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        q_begin, q_end = starts[s], starts[s + 1]
        for i, t in enumerate(range(q_begin, q_end)):
            pos = ctx - (q_end - q_begin) + i
            k_pos = torch.arange(ctx)
            visible = (k_pos <= pos) & (k_pos > pos - window if window else True)
            scores = torch.einsum("hd,khd->hk", query[t].float(), keys) * query.shape[2] ** -0.5
            scores[:, ~visible] = float("-inf")
            out[t] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
    return out.to(query.dtype)


@pytest.mark.parametrize("window", [1, 5, 16, 23, 1000])
def test_reference_decode_and_prefill_match_a_dense_masked_softmax(window, make_paged_cache) -> None:
    paged = make_paged_cache([1, 16, 40, 77], 16, 2, 32, F32, CPU)
    gen = torch.Generator().manual_seed(window)
    query = torch.randn(4, 4, 32, generator=gen)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 32**-0.5)
    expected = _dense(query, paged, [0, 1, 2, 3, 4], window)
    torch.testing.assert_close(reference.paged_decode_attention(*args, window), expected)

    q_lens = [1, 16, 9, 30]  # a decode, a whole prompt, two later chunks
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    chunk_q = torch.randn(sum(q_lens), 4, 32, generator=gen)
    got = reference.paged_prefill_attention(
        chunk_q, paged.k_cache, paged.v_cache, paged.block_tables,
        torch.tensor(starts, dtype=torch.int32), paged.context_lens, 32**-0.5, sliding_window=window,
    )  # fmt: skip
    torch.testing.assert_close(got, _dense(chunk_q, paged, starts, window))


def test_window_equal_to_no_window_when_it_covers_the_context(make_paged_cache) -> None:
    paged = make_paged_cache([7, 33], 16, 2, 32, F32, CPU)
    query = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.2)
    assert torch.equal(reference.paged_decode_attention(*args, 33), reference.paged_decode_attention(*args))


# (block_size, head_dim, num_heads, num_kv_heads, context_lens, window)
NATIVE_CASES = [
    (16, 32, 8, 4, [1, 16, 33, 7], 8),
    (16, 64, 4, 4, [17, 48, 5], 16),  # window on a block boundary
    (8, 80, 14, 2, [5, 33, 250], 21),  # window starting mid-block
    (16, 32, 4, 2, [40, 90], 1),  # only the query's own key
    (32, 128, 8, 1, [1, 96, 64, 33], 4096),  # wider than every context
]


@pytest.mark.parametrize("case", NATIVE_CASES, ids=lambda c: f"bs{c[0]}-d{c[1]}-w{c[5]}")
@pytest.mark.parametrize("threads", [1, 2])
def test_native_cpu_decode_matches_reference(case, threads, make_paged_cache, poison_allocations) -> None:
    from inflight.kernels import cpu_native

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    assert cpu_native.load_library()[0] is not None
    block_size, head_dim, num_heads, num_kv_heads, lens, window = case
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, F32, CPU)
    query = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(head_dim))
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, head_dim**-0.5)
    got = with_threads(threads, cpu_native.paged_decode_attention, *args, window)
    expected = reference.paged_decode_attention(*args, window)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=2e-5)


# (block_size, head_dim, num_heads, num_kv_heads, dtype, context_lens, window, forced split plan)
TRITON_DECODE_CASES = [
    (16, 64, 4, 4, F32, [1, 16, 33, 70], 8, None),
    (16, 64, 8, 2, F32, [1, 96, 64, 33], 20, (4, 16)),  # splits wholly before the window
    (32, 64, 8, 1, BF16, [65, 2, 32], 31, (2, 32)),
    (16, 80, 4, 2, F32, [5, 33], 1, None),
]


@pytest.mark.parametrize("case", TRITON_DECODE_CASES, ids=lambda c: f"bs{c[0]}-w{c[6]}-split{c[7]}")
def test_triton_decode_matches_reference(case, device, make_paged_cache, poison_allocations, assert_close) -> None:
    from inflight.kernels.triton_decode_attention import (
        decode_with_plan,
        paged_decode_attention,
        split_plan,
    )

    block_size, head_dim, num_heads, num_kv_heads, dtype, lens, window, split = case
    paged = make_paged_cache(lens, block_size, num_kv_heads, head_dim, dtype, device)
    gen = torch.Generator().manual_seed(len(lens) + window)
    query = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, head_dim**-0.5)
    expected = reference.paged_decode_attention(*args, window)
    if split is None:
        got = paged_decode_attention(*args, window)
    else:
        plan = split_plan(paged.block_tables.shape[1] * block_size, split[0], split[1])
        got = decode_with_plan(*args, plan, window)
    assert_close(got, expected)


# (block_size, head_dim, num_heads, num_kv_heads, dtype, [(q_len, context_len)], window, tiles)
TRITON_PREFILL_CASES = [
    (16, 64, 4, 4, F32, [(1, 1), (16, 16), (5, 37), (0, 9), (20, 52)], 8, (16, 16)),
    (16, 64, 8, 2, F32, [(48, 48), (1, 40), (33, 97)], 17, None),
    (32, 64, 4, 1, BF16, [(40, 64), (9, 41)], 1, (16, 16)),
    (16, 64, 4, 2, F32, [(30, 30)], 64, (16, 16)),  # window wider than the prompt
]


@pytest.mark.parametrize("case", TRITON_PREFILL_CASES, ids=lambda c: f"bs{c[0]}-w{c[6]}-tiles{c[7]}")
def test_triton_prefill_matches_reference(case, device, make_paged_cache, poison_allocations, assert_close) -> None:
    from inflight.kernels.triton_prefill_attention import (
        PrefillConfig,
        paged_prefill_attention,
        prefill_with_config,
    )

    block_size, head_dim, num_heads, num_kv_heads, dtype, chunks, window, tiles = case
    q_lens = [q for q, _ in chunks]
    paged = make_paged_cache([c for _, c in chunks], block_size, num_kv_heads, head_dim, dtype, device)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(sum(q_lens) + window)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, starts.to(device),
            paged.context_lens, head_dim**-0.5)  # fmt: skip
    expected = reference.paged_prefill_attention(*args, sliding_window=window)
    if tiles is None:
        got = paged_prefill_attention(*args, sliding_window=window)
    else:
        got = prefill_with_config(*args, PrefillConfig(block_m=tiles[0], block_n=tiles[1]), window)
    assert_close(got, expected)
