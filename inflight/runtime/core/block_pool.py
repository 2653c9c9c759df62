"""The KV block pool: fixed-size blocks, reference counts, a free queue and the prefix cache.

A block is free when no request holds it (``ref_cnt == 0``). Free blocks wait in an LRU
queue; a free block that still holds a full, hashed block of tokens stays findable in the
prefix cache until it is handed out again (evicted), oldest-freed first. Full blocks are
keyed by a chained SHA-256 (the parent block's key + this block's token ids, from a random
root per pool), so two requests whose prompts share a prefix share those blocks, and nobody
can compute a block whose key collides with another user's (Python's ``hash`` of a tuple is
public and cheap to collide: that was cross-user KV poisoning, as in vLLM's
GHSA-rm76-4mrf-v9r8). A hit is also checked against the block's own token ids, so even a
collision could never serve one prompt's KV to another.

A request's ``cache_salt`` (vLLM's isolation field) seeds its chain: the first block's key
covers the salt (:func:`salted_root`), and through chaining every later block's does too, so
only requests with the same salt (or none) share blocks, and a guess at another user's prompt
finds nothing unless it carries that user's salt.

With a host tier (:mod:`.host_tier`, ``kv_offloading_size``) behind the cache, a cached block
that :meth:`KVBlockPool.allocate` evicts is handed to the tier (which plans its copy to host
memory) before the block is reused; a prefix-cache reset clears the tier too.

With KV events on (``--kv-events-config``), the pool tells its collector
(:mod:`inflight.runtime.kv_events.collector`) each key that becomes findable and each that stops
being findable, and a reset that empties the cache (and the host tier), so a router can follow
the cache exactly; the host tier tells the same collector what it takes and drops (medium "CPU").
A key cached ``announce=False`` (the per-group keys of :mod:`.kv_groups`, which no router knows)
is findable here but never told, neither when it is stored nor when it is evicted.

This module imports no torch and knows nothing about requests or scheduling policy.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inflight.runtime.core.host_tier import HostTier
    from inflight.runtime.kv_events.collector import KVEventCollector

BlockHash = bytes  # a SHA-256 digest
NO_PARENT_HASH: BlockHash = bytes(32)  # the root of tests' chains; a pool draws a random one


def salted_root(root: BlockHash, cache_salt: str | None) -> BlockHash:
    """The chain root of a request with ``cache_salt``: ``root`` itself without a salt, else
    SHA-256(root, a domain tag, the salt's UTF-8), so salted chains never meet unsalted ones."""
    if cache_salt is None:
        return root
    return hashlib.sha256(root + b"inflight-cache-salt\0" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def adapter_root(root: BlockHash, adapter_key: str) -> BlockHash:
    """The chain root of a request run with a LoRA adapter (``adapter_key``: its name and weights'
    digest) from its salted ``root``: SHA-256 under another domain tag, so an adapter's chains never
    meet the base model's, another adapter's, or a salt's."""
    return hashlib.sha256(root + b"inflight-lora\0" + adapter_key.encode("utf-8", "surrogatepass")).digest()


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chained key of one full block of tokens: SHA-256(parent key, token ids as int64)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, parent_hashes: Sequence[BlockHash] = (),
    root: BlockHash = NO_PARENT_HASH,
) -> list[BlockHash]:
    """Chained keys of every full block of ``token_ids`` from ``root``, reusing ``parent_hashes``."""
    hashes = list(parent_hashes)
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class KVBlockPool:
    """Hands out block ids; tracks ref counts and the prefix cache."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks}).")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash: BlockHash = os.urandom(32)  # keys differ between servers and restarts
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # checked on a hit
        # Free blocks in eviction order: the first key is evicted first.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # block key -> block id
        self._quiet: set[BlockHash] = set()  # cached keys the events never hear of (announce=False)
        self.host_tier: HostTier | None = None  # keeps the cached blocks evicted here (set by the KV manager)
        self._events: KVEventCollector | None = None

    @property
    def events(self) -> KVEventCollector | None:
        """Told what becomes findable and what stops (kv_events); the host tier reports to it too."""
        return self._events

    @events.setter
    def events(self, collector: KVEventCollector | None) -> None:
        self._events = collector
        if self.host_tier is not None:
            self.host_tier.events = collector

    def root_for(self, cache_salt: str | None) -> BlockHash:
        """The chain root of a request with ``cache_salt`` in this pool (see :func:`salted_root`)."""
        return salted_root(self.root_hash, cache_salt)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` fresh blocks (ref 1), evicting cached ones LRU; None if too few."""
        if num_blocks > len(self._free):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id, save=True)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit); revives free ones."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block. Blocks reaching zero join the free queue.

        Freed in reverse so that a sequence's tail blocks are evicted before its head
        blocks, which are the ones other prompts are likeliest to share.
        """
        for block_id in reversed(block_ids):
            if self.ref_cnt[block_id] <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def find_cached(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], block_size: int
    ) -> list[int]:
        """The longest run of leading blocks found in the cache whose tokens are
        ``token_ids``' own (takes no references)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for i, h in enumerate(block_hashes):
            block_id = self._cached.get(h)
            if block_id is None or self.block_tokens[block_id] != tuple(
                token_ids[i * block_size : (i + 1) * block_size]
            ):
                break
            hits.append(block_id)
        return hits

    def find_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The cached block keyed ``block_hash`` holding ``token_ids``, or None (takes no reference)."""
        block_id = self._cached.get(block_hash) if self.enable_prefix_caching else None
        if block_id is None or self.block_tokens[block_id] != tuple(token_ids):
            return None
        return block_id

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` sit in the free queue (sharing them uses up free blocks)."""
        return sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def cache_block(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int],
                    parent_hash: BlockHash | None = None, lora_id: int | None = None,
                    lora_name: str | None = None, announce: bool = True) -> None:
        """Record that ``block_id`` holds the full block ``token_ids`` keyed ``block_hash``.
        ``parent_hash`` (None for a chain's first block) and the LoRA adapter only go into the
        KV event of a block that becomes findable; ``announce=False``: no event, now or at eviction."""
        if not self.enable_prefix_caching or self.block_hash[block_id] is not None:
            return
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tuple(token_ids)
        if self._cached.setdefault(block_hash, block_id) == block_id:
            if not announce:
                self._quiet.add(block_hash)
            elif self.events is not None:
                self.events.stored(block_hash, parent_hash, token_ids, lora_id, lora_name)

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._free):
            self._evict(block_id)
        if self.host_tier is not None:
            self.host_tier.clear()
        if self.events is not None and not self._cached and (self.host_tier is None or not self.host_tier.num_used_slots):
            self.events.cleared()  # else the evicted ones went out one by one (held or pinned blocks stay)

    def _evict(self, block_id: int, save: bool = False) -> None:
        """Forget ``block_id``'s key; ``save``: hand the block to the host tier first (if any)."""
        h = self.block_hash[block_id]
        if h is None:
            return
        tokens = self.block_tokens[block_id]
        self.block_hash[block_id] = None
        self.block_tokens[block_id] = None
        if self._cached.get(h) == block_id:
            del self._cached[h]
            if h in self._quiet:  # a group's key: no host copy, no event
                self._quiet.discard(h)
                return
            # Saved first: a router hears the host copy while it still knows the device block.
            if save and self.host_tier is not None and tokens is not None:
                self.host_tier.save(block_id, h, tokens)
            if self.events is not None:
                self.events.removed(h)

    def check_invariants(self) -> None:
        """Internal consistency, for tests: free queue == blocks with ref 0, cache map sane."""
        free = set(self._free)
        for block_id in range(self.num_blocks):
            ref = self.ref_cnt[block_id]
            assert ref >= 0, f"negative ref count on block {block_id}"
            assert (ref == 0) == (block_id in free), f"free queue disagrees on block {block_id}"
        for h, block_id in self._cached.items():
            assert self.block_hash[block_id] == h, f"cache map disagrees on block {block_id}"
