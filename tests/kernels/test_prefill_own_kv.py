"""The torch prefill attention over a chunk's own K/V equals the one that reads them back from the cache."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import reference


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2)])
def test_own_kv_matches_cache_gather(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(7)
    block_size, head_dim, num_blocks = 16, 32, 24
    # (q_len, context_len): whole prompts (own K/V used) mixed with later chunks (cache read).
    chunks = [(37, 37), (5, 21), (16, 16), (1, 1), (20, 52)]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    max_blocks = 4
    tables = torch.arange(len(chunks) * max_blocks, dtype=torch.int32).view(len(chunks), max_blocks)
    num_tokens = sum(q for q, _ in chunks)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    slots = [int(tables[s, p // block_size]) * block_size + p % block_size
             for s, (q, ctx) in enumerate(chunks) for p in range(ctx - q, ctx)]
    reference.store_kv_cache(key, value, k_cache, v_cache, torch.tensor(slots))
    starts = torch.tensor([0, *torch.tensor([q for q, _ in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([c for _, c in chunks], dtype=torch.int32)
    args = (query, k_cache, v_cache, tables, starts, lens, head_dim**-0.5)
    gathered = reference.paged_prefill_attention(*args)
    own = reference.paged_prefill_attention(*args, key=key, value=value)
    torch.testing.assert_close(own, gathered, rtol=1e-5, atol=1e-5)
    # The chunk's K/V really are used for whole prompts: other values change the answer there.
    other = reference.paged_prefill_attention(*args, key=key + 1.0, value=value)
    assert not torch.allclose(other[:37], gathered[:37])
    torch.testing.assert_close(other[37:42], gathered[37:42])  # a later chunk still reads the cache
