"""Triton packed prefill / chunked-context attention against the torch reference."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (block_size, head_dim, num_heads, num_kv_heads, dtype, [(q_len, context_len)], tiles)
# context_len > q_len is a later chunk or a prefix-cache hit; q_len 0 is a sequence with
# nothing scheduled; q_len 1 is a decode riding in the same batch. tiles=None: the planner's.
CASES = [
    (16, 64, 4, 4, F32, [(1, 1), (16, 16), (5, 37), (0, 9), (20, 52)], (16, 16)),
    (32, 128, 8, 2, BF16, [(32, 32), (7, 40), (33, 97)], None),
    (16, 128, 8, 1, F16, [(17, 17), (3, 19)], (16, 32)),
    (32, 64, 8, 1, F32, [(40, 64), (1, 33)], None),
    (16, 64, 8, 2, BF16, [(48, 48), (1, 16)], (16, 16)),
    (32, 96, 4, 1, F16, [(9, 41)], (16, 16)),  # head_dim not a power of two
]


def _ids(case: tuple) -> str:
    bs, d, h, hkv, dtype, _, tiles = case
    return f"bs{bs}-d{d}-gqa{h // hkv}-{str(dtype)[6:]}-tiles{tiles[0] if tiles else 'auto'}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_prefill_matches_reference(
    case, device, make_paged_cache, poison_allocations, assert_close
) -> None:
    from inflight.kernels.triton_prefill_attention import (
        PrefillConfig,
        paged_prefill_attention,
        prefill_with_config,
    )

    block_size, head_dim, num_heads, num_kv_heads, dtype, chunks, tiles = case
    q_lens = [q for q, _ in chunks]
    paged = make_paged_cache(
        [c for _, c in chunks], block_size, num_kv_heads, head_dim, dtype, device
    )
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(sum(q_lens) + head_dim)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype).to(device)
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, starts.to(device),
            paged.context_lens, head_dim**-0.5)  # fmt: skip
    expected = reference.paged_prefill_attention(*args)
    if tiles is None:
        got = paged_prefill_attention(*args)
    else:
        got = prefill_with_config(*args, PrefillConfig(block_m=tiles[0], block_n=tiles[1]))
    assert_close(got, expected)


def test_prefill_no_queries(device) -> None:
    from inflight.kernels.triton_prefill_attention import paged_prefill_attention

    cache = torch.randn(2, 16, 1, 64, device=device)
    out = paged_prefill_attention(
        torch.randn(0, 2, 64, device=device), cache, cache,
        torch.zeros(1, 1, dtype=torch.int32, device=device),
        torch.zeros(2, dtype=torch.int32, device=device),
        torch.ones(1, dtype=torch.int32, device=device), 0.1,
    )  # fmt: skip
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize(
    ("num_tokens", "num_seqs", "block_m"), [(1, 1, 16), (40, 2, 32), (4096, 2, 64)]
)
def test_plan_prefill_tiles(num_tokens, num_seqs, block_m) -> None:
    from inflight.kernels.triton_prefill_attention import plan_prefill

    assert plan_prefill(num_tokens, num_seqs, 128).block_m == block_m


def test_prefill_rejects_bad_query_start_loc(device) -> None:
    from inflight.kernels.triton_prefill_attention import paged_prefill_attention

    cache = torch.randn(2, 16, 1, 64, device=device)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
    lens = torch.ones(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="num_seqs \\+ 1"):
        paged_prefill_attention(
            torch.randn(2, 2, 64, device=device), cache, cache, tables,
            torch.tensor([0, 2], dtype=torch.int32, device=device), lens, 0.1,
        )  # fmt: skip


def test_plan_prefill_narrows_key_tiles_for_wide_rows() -> None:
    from inflight.kernels.triton_prefill_attention import plan_prefill

    assert plan_prefill(4096, 2, 128, elem_size=2).block_n == 64
    assert plan_prefill(4096, 2, 128, elem_size=4).block_n == 32
    assert plan_prefill(4096, 2, 256, elem_size=2).block_n == 32
