"""KVCacheManager: maps requests onto blocks of the pool, including prefix-cache hits.

It answers "can this request get slots for N more tokens?" (allocating them if so), frees a
request's blocks, and registers blocks in the prefix cache as they fill with computed
tokens. Imports no torch; knows nothing about scheduling policy.
"""

from __future__ import annotations

from inflight.runtime.block_pool import KVBlockPool, hash_full_blocks
from inflight.runtime.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block bookkeeping on top of a :class:`KVBlockPool`."""

    def __init__(self, pool: KVBlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found cached

    def find_prefix_hit(self, req: Request) -> list[int]:
        """Cached blocks covering a prefix of ``req``'s tokens (at least one token stays to compute)."""
        if not self.pool.enable_prefix_caching or req.num_computed_tokens > 0:
            return []
        if req.params.prompt_logprobs is not None:  # cached tokens would have no logits
            return []
        req.block_hashes = hash_full_blocks(req.token_ids, self.block_size, req.block_hashes, self.pool.root_hash)
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.pool.find_cached(req.block_hashes[:max_blocks], req.token_ids, self.block_size)

    def blocks_needed(self, req: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """Fresh blocks ``req`` needs to hold ``num_new_tokens`` more tokens."""
        total_tokens = req.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        return max(0, cdiv(total_tokens, self.block_size) - len(req.block_ids) - num_hit_blocks)

    def allocate_slots(
        self, req: Request, num_new_tokens: int, hit_blocks: list[int] | None = None
    ) -> bool:
        """Give ``req`` room for ``num_new_tokens`` more tokens (after any prefix hit).

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        hit_blocks = hit_blocks or []
        num_fresh = self.blocks_needed(req, num_new_tokens, len(hit_blocks))
        # Sharing a cached block that sits in the free queue uses up one free block.
        if num_fresh + self.pool.num_free_among(hit_blocks) > self.pool.num_free_blocks:
            return False
        if hit_blocks:
            self.pool.share(hit_blocks)
            req.block_ids.extend(hit_blocks)
            req.num_computed_tokens += len(hit_blocks) * self.block_size
            req.num_cached_blocks = len(req.block_ids)
        fresh = self.pool.allocate(num_fresh)
        if fresh is None:  # cannot happen after the check above
            raise RuntimeError("KV block pool refused an allocation it had room for")
        req.block_ids.extend(fresh)
        return True

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += num_hit_tokens

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the blocks that are now full of computed tokens in the prefix cache."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_cached_blocks:
            return
        bs = self.block_size
        req.block_hashes = hash_full_blocks(
            req.token_ids[: num_full * bs], bs, req.block_hashes[:num_full], self.pool.root_hash
        )
        for i in range(req.num_cached_blocks, num_full):
            self.pool.cache_block(req.block_ids[i], req.block_hashes[i], req.token_ids[i * bs : (i + 1) * bs])
        req.num_cached_blocks = num_full

    def free(self, req: Request) -> None:
        """Release all of ``req``'s blocks; full ones stay in the prefix cache until evicted."""
        if req.block_ids:
            self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0
