"""KVCacheManager: maps requests onto blocks of the pool, including prefix-cache hits.

It answers "can this request get slots for N more tokens?" (allocating them if so), frees a
request's blocks, and registers blocks in the prefix cache as they fill with computed
tokens. Imports no torch; knows nothing about scheduling policy.

Sliding windows: when *every* layer of the model attends within a window of ``W`` tokens (a
query at position ``p`` reads keys ``p - W + 1 .. p``), a request's blocks wholly before
``num_computed_tokens - W + 1`` can never be read again: every future query sits at
``num_computed_tokens`` or later (speculative rollback only drops drafts beyond it; only
preemption moves it back, and preemption frees everything). Those blocks are released
(:meth:`KVCacheManager.release_out_of_window`) while their entries stay in ``block_ids`` as
placeholders, so ``block_table[pos // block_size]`` still finds every live block. The kernels
never weigh a key before the window: the native and Triton ones never load those blocks, the
torch reference gathers them and masks them out, so a placeholder only needs to be a valid
block index holding finite values, which the released id is (another request may own it by
then; it is masked, like the stale tail of a last block or the padding of a table).
Here one block table serves all layers, so a model with any global (full-attention) layer, such
as Gemma 3 or Qwen2 with ``max_window_layers`` below its layer count, releases nothing (see
:func:`release_window`); such a model normally gets one table per group of layers instead
(:class:`~inflight.runtime.core.kv_groups.GroupedKVCacheManager`, a subclass of this one).

Hybrid models (Qwen3-Next): ``state_pool`` (:mod:`.state_pool`) gives each request its
per-sequence state slot with its first blocks and takes it back with its blocks (finish, abort,
preemption); an admission with no free slot fails like one with no free block.

Host tier (``kv_offloading_size``, :mod:`.host_tier`): the pool hands the cached blocks it
evicts to the tier, and a prefix lookup that stops in the device cache goes on in the tier
(:class:`PrefixHit`); each host hit gets a fresh device block, registered in the cache at once,
and a copy-in that the worker runs before the step's forward. Not with sliding-window release
(the engine leaves the tier off there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.runtime.core.block_pool import KVBlockPool, adapter_root, hash_full_blocks
from inflight.runtime.core.request import Request
from inflight.runtime.core.sched_output import KVCopies
from inflight.runtime.multimodal.inputs import mm_block_hashes

if TYPE_CHECKING:
    from inflight.runtime.core.host_tier import HostTier
    from inflight.runtime.core.state_pool import StatePool
    from inflight.runtime.model.spec import ModelSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def release_window(*specs: ModelSpec) -> int | None:
    """The window (tokens) beyond which a request's blocks may be released, or None.

    The models' (the served one's, and a draft model's that reads the same blocks) largest
    ``sliding_window`` when every layer of each is windowed; None when any layer attends to
    the whole context (it may read every block, and the block table is shared by all layers).
    """
    windows = []
    for spec in specs:
        if spec.sliding_window is None or set(spec.sliding_layers) != set(range(spec.num_layers)):
            return None
        windows.append(spec.sliding_window)
    return max(windows, default=None)


class PrefixHit(list[int]):
    """A prefix hit that goes on in the host tier: the first ``num_device`` items are device
    block ids, the rest host slots (in block order). Its length is the blocks hit in all."""

    def __init__(self, items: list[int], num_device: int) -> None:
        super().__init__(items)
        self.num_device = num_device


class KVCacheManager:
    """Per-request block bookkeeping on top of a :class:`KVBlockPool`.

    ``sliding_window``: from :func:`release_window`; None keeps every block a request fills.
    ``host_tier``: keeps the pool's evicted cached blocks (prefix caching on, no window).
    """

    def __init__(self, pool: KVBlockPool, block_size: int, sliding_window: int | None = None,
                 host_tier: HostTier | None = None, state_pool: StatePool | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens (got {sliding_window}).")
        if host_tier is not None and (sliding_window is not None or not pool.enable_prefix_caching):
            raise ValueError("a host KV tier needs prefix caching on and no sliding-window block release")
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.host_tier = host_tier
        self.state_pool = state_pool  # a hybrid model's per-sequence states (core/state_pool.py), else None
        pool.host_tier = host_tier
        if host_tier is not None:
            host_tier.events = pool.events
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of which found cached on the device
        self._host_hit_tokens = 0  # of the last hit taken (allocate_slots), those from the host tier

    def find_prefix_hit(self, req: Request) -> list[int]:
        """Cached blocks covering a prefix of ``req``'s tokens (at least one token stays to compute)."""
        self._host_hit_tokens = 0
        if not self.pool.enable_prefix_caching or req.num_computed_tokens > 0:
            return []
        if req.params.prompt_logprobs is not None:  # cached tokens would have no logits
            return []
        req.block_hashes = self._hashes(req, req.token_ids)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = self.pool.find_cached(req.block_hashes[:max_blocks], req.token_ids, self.block_size)
        host = self.host_tier
        if host is None or len(hits) == max_blocks:
            return hits
        slots = host.find(req.block_hashes[:max_blocks], req.token_ids, self.block_size, len(hits))
        return PrefixHit(hits + slots, len(hits)) if slots else hits

    def blocks_needed(self, req: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """Fresh blocks ``req`` needs to hold ``num_new_tokens`` more tokens."""
        total_tokens = req.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        return max(0, cdiv(total_tokens, self.block_size) - len(req.block_ids) - num_hit_blocks)

    def num_out_of_window(self, num_computed_tokens: int) -> int:
        """Leading blocks no query at ``num_computed_tokens`` or later can read (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed_tokens - self.sliding_window + 1) // self.block_size)

    def release_out_of_window(self, req: Request) -> int:
        """Give back ``req``'s leading blocks that fell wholly outside the window; how many.

        Their table entries stay as placeholders. With prefix caching a block is released only
        once it is registered in the cache (it stays findable there until evicted, like any
        freed cached block); a block other requests share stays theirs (ref counts).
        """
        if self.sliding_window is None:
            return 0
        upto = min(self.num_out_of_window(req.num_computed_tokens), len(req.block_ids))
        if self.pool.enable_prefix_caching:
            upto = min(upto, req.num_cached_blocks)
        if upto <= req.num_released_blocks:
            return 0
        self.pool.free(req.block_ids[req.num_released_blocks : upto])
        released = upto - req.num_released_blocks
        req.num_released_blocks = upto
        return released

    def allocate_slots(
        self, req: Request, num_new_tokens: int, hit_blocks: list[int] | None = None
    ) -> bool:
        """:meth:`_allocate_blocks`, and for a hybrid model a state slot with the first blocks (False,
        changing nothing, when no slot is free)."""
        states = self.state_pool
        if states is None or states.holds(req.req_id):
            return self._allocate_blocks(req, num_new_tokens, hit_blocks)
        if states.allocate(req.req_id) is None:
            return False
        if not self._allocate_blocks(req, num_new_tokens, hit_blocks):
            states.free(req.req_id)
            return False
        return True

    def _allocate_blocks(
        self, req: Request, num_new_tokens: int, hit_blocks: list[int] | None = None
    ) -> bool:
        """Give ``req`` room for ``num_new_tokens`` more tokens (after any prefix hit).

        First releases ``req``'s blocks already out of the window (never read again, so that
        stays done). Otherwise returns False, changing nothing, when the pool has too few free
        blocks. A prefix hit (only at admission, on an empty table) shares just the hit blocks
        still inside the window; the ones before it become placeholders straight away.
        """
        if not hit_blocks:  # a running request: usually room left in its last block
            if self.sliding_window is not None:
                self.release_out_of_window(req)
            num_fresh = self.blocks_needed(req, num_new_tokens)
            if num_fresh == 0:
                return True
            fresh = self.pool.allocate(num_fresh)
            if fresh is None:
                return False
            req.block_ids.extend(fresh)
            return True
        if req.block_ids:
            raise RuntimeError(f"prefix hit for {req.req_id!r}, which already holds blocks")
        self.release_out_of_window(req)
        num_fresh = self.blocks_needed(req, num_new_tokens, len(hit_blocks))
        num_device = hit_blocks.num_device if isinstance(hit_blocks, PrefixHit) else len(hit_blocks)
        slots = hit_blocks[num_device:]  # host hits: each needs a fresh block and a copy-in
        num_skip = min(num_device, self.num_out_of_window(len(hit_blocks) * self.block_size))
        shared = hit_blocks[num_skip:num_device]
        # Sharing a cached block that sits in the free queue uses up one free block.
        if num_fresh + len(slots) + self.pool.num_free_among(shared) > self.pool.num_free_blocks:
            return False
        # Shared before allocating, so the fresh blocks cannot evict them. A skipped one may be
        # evicted and even come back to this request as a fresh block: harmless, its
        # placeholder entry is never weighed.
        self.pool.share(shared)
        req.block_ids.extend(hit_blocks[:num_device])
        if slots:
            req.block_ids.extend(self._load_from_host(req, num_device, slots))
        self._host_hit_tokens = len(slots) * self.block_size
        req.num_released_blocks = num_skip
        req.num_computed_tokens += len(hit_blocks) * self.block_size
        req.num_cached_blocks = len(req.block_ids)
        fresh = self.pool.allocate(num_fresh)
        if fresh is None:  # cannot happen after the check above
            raise RuntimeError("KV block pool refused an allocation it had room for")
        req.block_ids.extend(fresh)
        return True

    def _load_from_host(self, req: Request, first: int, slots: list[int]) -> list[int]:
        """Fresh device blocks for ``req``'s host hits (blocks ``first, first + 1, ...``), their
        copy-ins planned and each registered in the device cache (the copy-in runs before any
        step that reads it). The slots are pinned first, so the evictions this allocation
        causes cannot reuse them."""
        host = self.host_tier
        assert host is not None
        host.pin(slots)
        loaded = self.pool.allocate(len(slots))
        if loaded is None:  # checked by the caller
            raise RuntimeError("KV block pool refused an allocation it had room for")
        host.load(slots, loaded)
        for i, block_id in enumerate(loaded, start=first):
            self._cache_block(req, i, block_id)
        return loaded

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        """A request's first admission looked up ``num_prompt_tokens`` and hit ``num_hit_tokens``
        (device and host hits together, as :meth:`allocate_slots` took them): the device's share
        counts as prefix-cache hits, the rest of the lookup as the host tier's (vLLM's external
        prefix cache: its queries are the tokens past the device hits)."""
        host_tokens, self._host_hit_tokens = self._host_hit_tokens, 0
        device_tokens = num_hit_tokens - host_tokens
        self.prefix_cache_queries += num_prompt_tokens
        self.prefix_cache_hits += device_tokens
        if self.host_tier is not None:
            self.host_tier.record_lookup(num_prompt_tokens - device_tokens, host_tokens)

    def take_copies(self) -> KVCopies | None:
        """The host tier's copies planned since the last call (None: none or no tier)."""
        return self.host_tier.take_copies() if self.host_tier is not None else None

    def cache_computed_blocks(self, req: Request, num_computed: int | None = None) -> None:
        """Register the blocks that are now full of computed tokens in the prefix cache (with a
        draft model, only once its KV fills them too: ``Request.draft_kv_lag``). ``num_computed``:
        count only this many (async scheduling: the tokens of steps that have run, not of the
        step still in flight)."""
        if not self.pool.enable_prefix_caching:
            return
        computed = req.num_computed_tokens if num_computed is None else min(num_computed, req.num_computed_tokens)
        num_full = (computed - req.draft_kv_lag) // self.block_size
        if num_full <= req.num_cached_blocks:
            return
        req.block_hashes = self._hashes(req, req.token_ids[: num_full * self.block_size])
        for i in range(req.num_cached_blocks, num_full):
            self._cache_block(req, i, req.block_ids[i])
        req.num_cached_blocks = num_full

    def _cache_block(self, req: Request, i: int, block_id: int) -> None:
        """Register ``req``'s block ``i`` (held in ``block_id``) in the prefix cache; its parent's
        key and its adapter go into the KV event, if events are on."""
        bs, lora = self.block_size, req.lora
        self.pool.cache_block(block_id, req.block_hashes[i], req.token_ids[i * bs : (i + 1) * bs],
                              req.block_hashes[i - 1] if i else None,
                              None if lora is None else lora.load_id, None if lora is None else lora.name)

    def _hashes(self, req: Request, token_ids: list[int]) -> list[bytes]:
        """Chained keys of the full blocks of ``token_ids`` (a prefix of ``req``'s), extending the
        ones ``req`` has; the chain starts from ``req``'s salted root (``cache_salt``)."""
        known = req.block_hashes[: len(token_ids) // self.block_size]
        root = self.pool.root_hash if known or req.cache_salt is None else self.pool.root_for(req.cache_salt)
        if not known and req.lora is not None:  # an adapter's KV is its own (issue 49)
            root = adapter_root(root, req.lora.cache_key)
        if req.mm_inputs is not None:  # blocks holding image tokens are keyed by the image too
            return mm_block_hashes(token_ids, self.block_size, known, root, req.mm_inputs)
        return hash_full_blocks(token_ids, self.block_size, known, root)

    def free(self, req: Request) -> None:
        """Release all of ``req``'s held blocks (not the placeholders of released ones); full
        ones stay in the prefix cache until evicted."""
        held = req.block_ids[req.num_released_blocks :]
        if held:
            self.pool.free(held)
        req.block_ids = []
        req.num_released_blocks = 0
        req.num_cached_blocks = 0
        if self.state_pool is not None:
            self.state_pool.free(req.req_id)
