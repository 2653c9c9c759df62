"""Triton KV-cache store against the torch reference."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import reference

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

# (block_size, head_dim, num_kv_heads, input dtype, cache dtype)
CASES = [
    (16, 64, 1, F32, F32),
    (32, 128, 2, BF16, BF16),
    (16, 128, 8, F16, F16),
    (32, 64, 4, F32, BF16),  # the cache dtype wins: a cast on store
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"bs{c[0]}-d{c[1]}-h{c[2]}-{str(c[4])[6:]}")
def test_store_matches_reference(case, device, assert_close) -> None:
    from inflight.kernels.triton_kv_store import store_kv_cache

    block_size, head_dim, num_kv_heads, dtype, cache_dtype = case
    num_blocks, num_tokens, num_heads = 4, 9, 2 * num_kv_heads
    gen = torch.Generator().manual_seed(block_size + head_dim + num_kv_heads)
    # K and V as strided views into a fused QKV projection, the way a model produces them.
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype).to(device)
    k_begin, v_begin = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    key = qkv[:, k_begin:v_begin].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, v_begin:].view(num_tokens, num_kv_heads, head_dim)
    # Distinct slots including both sides of a block boundary, and one skipped (-1) token.
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[:3] = torch.tensor([block_size - 1, block_size, 0])
    slots[5] = -1
    slots = slots.to(device)
    # NaN everywhere: a slot the kernel should write but does not stays NaN and fails.
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), dtype=cache_dtype, device=device) for _ in range(4)]
    reference.store_kv_cache(key, value, caches[0], caches[1], slots)
    store_kv_cache(key, value, caches[2], caches[3], slots)
    written = caches[2].isfinite().view(num_blocks * block_size, -1).all(1)  # per slot
    assert written.sum() == num_tokens - 1
    assert_close(caches[2].nan_to_num(7.0), caches[0].nan_to_num(7.0))
    assert_close(caches[3].nan_to_num(7.0), caches[1].nan_to_num(7.0))


def test_store_no_tokens(device) -> None:
    from inflight.kernels.triton_kv_store import store_kv_cache

    cache = torch.randn(2, 16, 1, 64, device=device)
    before = cache.clone()
    empty = torch.randn(0, 1, 64, device=device)
    store_kv_cache(empty, empty, cache, cache, torch.zeros(0, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)


def test_store_rejects_mismatched_shapes(device) -> None:
    from inflight.kernels.triton_kv_store import store_kv_cache

    cache = torch.randn(2, 16, 2, 64, device=device)
    key = torch.randn(3, 1, 64, device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="match the cache"):
        store_kv_cache(key, key, cache, cache, slots)
    key = torch.randn(3, 2, 64, device=device)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries"):
        store_kv_cache(key, key, cache, cache, slots[:2])
    with pytest.raises(ValueError, match="share strides"):
        store_kv_cache(key, key, cache, cache.transpose(1, 2).contiguous().transpose(1, 2), slots)
