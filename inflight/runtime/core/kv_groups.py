"""Per-group KV tables: a request holds one block list per group of layers, all from one pool.

The worker groups a model's layers by window (:mod:`inflight.runtime.worker.kv_layout`: Gemma 3's
sliding and global layers, gpt-oss's sliding and full ones); :class:`GroupedKVCacheManager` gives
each request one block table per group (``Request.group_block_ids``, group 0's list being
``block_ids``) from the one shared :class:`~.block_pool.KVBlockPool`, as vLLM's hybrid allocator
does. A windowed group gives its blocks wholly before ``num_computed_tokens - W + 1`` back to the
pool as the request advances (placeholders stay in its table, as :mod:`.kv_manager` explains for a
model whose every layer is windowed); a full-attention group keeps all of its own. So a windowed
group holds about ``ceil(W / block_size) + 1`` blocks plus its new tokens', whatever the length.

Allocation counts every group's blocks (it succeeds for all groups or changes nothing);
freeing and preemption free every group's. Prefix caching: each group's full blocks are keyed by
the request's chained block key and the group (:func:`group_key`; group 0 keeps the plain key,
the one KV events report; the other groups' keys are cached ``announce=False``). A hit of ``h``
blocks is taken only where every group agrees: group 0's leading run of cached blocks, cut back
to the longest ``h`` for which every other full-attention group has blocks ``0 .. h - 1`` cached
and every windowed group the blocks of its window before position ``h * block_size`` (the ones
before it become placeholders). The host tier is not used with groups (the worker declines
grouping when ``kv_offloading_size`` is set). Imports no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from inflight.runtime.core.block_pool import BlockHash, KVBlockPool
from inflight.runtime.core.kv_manager import KVCacheManager, cdiv
from inflight.runtime.core.request import Request

if TYPE_CHECKING:
    from inflight.runtime.core.state_pool import StatePool


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """Group ``group``'s prefix-cache key for the block keyed ``block_hash`` (group 0: itself)."""
    if group == 0:
        return block_hash
    return hashlib.sha256(block_hash + b"inflight-kv-group\0" + group.to_bytes(4, "little")).digest()


class GroupHit(list[int]):
    """A prefix hit over every group: the list is group 0's hit block ids; ``groups[g]`` group g's
    (None where a windowed group's block is before its window and need not be cached)."""

    def __init__(self, groups: list[list[int | None]]) -> None:
        super().__init__(groups[0])  # type: ignore[arg-type]
        self.groups = groups


class GroupedKVCacheManager(KVCacheManager):
    """:class:`KVCacheManager` with one block table per group; ``windows[g]``: group g's sliding
    window (None: full attention). ``pool`` holds every group's blocks."""

    def __init__(self, pool: KVBlockPool, block_size: int, windows: Sequence[int | None],
                 state_pool: StatePool | None = None) -> None:
        if len(windows) < 2:
            raise ValueError(f"per-group KV tables need at least two groups (got {len(windows)}).")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"a group's sliding window must be a positive number of tokens (got {windows}).")
        super().__init__(pool, block_size, None, None, state_pool)
        self.windows = tuple(windows)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def sliding_window(self) -> int | None:  # type: ignore[override]
        """Not None when some group is windowed, so the scheduler releases before each step."""
        return min((w for w in self.windows if w is not None), default=None)

    @sliding_window.setter
    def sliding_window(self, value: int | None) -> None:  # the base class's __init__ sets None
        if value is not None:
            raise ValueError("a grouped KV manager's windows are per group")

    # -- tables -------------------------------------------------------------------------
    def _tables(self, req: Request) -> list[list[int]]:
        """``req``'s tables, made (empty) on first use; group 0's list is ``req.block_ids``."""
        groups = req.group_block_ids
        if groups is None or groups[0] is not req.block_ids:
            groups = req.group_block_ids = [req.block_ids, *([] for _ in self.windows[1:])]
            req.group_released = [req.num_released_blocks] + [0] * (self.num_groups - 1)
        return groups

    def _out_of_window(self, group: int, num_computed_tokens: int) -> int:
        """Leading blocks of ``group`` no query at ``num_computed_tokens`` or later reads."""
        w = self.windows[group]
        return 0 if w is None else max(0, (num_computed_tokens - w + 1) // self.block_size)

    def blocks_needed(self, req: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """Fresh blocks ``req`` needs over every group for ``num_new_tokens`` more tokens."""
        total = cdiv(req.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens, self.block_size)
        tables = req.group_block_ids or [req.block_ids] * self.num_groups
        return sum(max(0, total - len(t) - num_hit_blocks) for t in tables)

    def num_out_of_window(self, num_computed_tokens: int) -> int:
        return self._out_of_window(0, num_computed_tokens)

    def release_out_of_window(self, req: Request) -> int:
        """Give back every windowed group's leading blocks wholly before its window; how many
        (with prefix caching, only blocks registered in the cache, as the base class does)."""
        if req.group_block_ids is None:
            return 0
        tables, released = self._tables(req), req.group_released
        total = 0
        for g, table in enumerate(tables):
            upto = min(self._out_of_window(g, req.num_computed_tokens), len(table))
            if self.pool.enable_prefix_caching:
                upto = min(upto, req.num_cached_blocks)
            if upto > released[g]:
                self.pool.free(table[released[g] : upto])
                total += upto - released[g]
                released[g] = upto
        req.num_released_blocks = released[0]
        return total

    # -- prefix hits --------------------------------------------------------------------
    def find_prefix_hit(self, req: Request) -> list[int]:
        """The longest prefix hit every group agrees on (see the module docstring)."""
        first = super().find_prefix_hit(req)  # group 0's run (and req.block_hashes)
        if not first:
            return []
        bs, hashes = self.block_size, req.block_hashes
        found: list[list[int | None]] = [list(first)]
        for g in range(1, self.num_groups):  # each group's cached blocks among group 0's run
            found.append([self.pool.find_block(group_key(hashes[i], g), req.token_ids[i * bs : (i + 1) * bs])
                          for i in range(len(first))])  # fmt: skip
        for h in range(len(first), 0, -1):
            needed = [self._out_of_window(g, h * bs) for g in range(self.num_groups)]
            if all(b is not None for g in range(1, self.num_groups) for b in found[g][needed[g] : h]):
                return GroupHit([[None] * needed[g] + found[g][needed[g] : h] for g in range(self.num_groups)])
        return []

    # -- allocation ---------------------------------------------------------------------
    def _allocate_blocks(self, req: Request, num_new_tokens: int, hit_blocks: list[int] | None = None) -> bool:
        """Room for ``num_new_tokens`` more tokens in every group (after any prefix hit), or
        False changing nothing; first releases what fell out of each windowed group's window."""
        tables = self._tables(req)
        if hit_blocks and req.block_ids:
            raise RuntimeError(f"prefix hit for {req.req_id!r}, which already holds blocks")
        self.release_out_of_window(req)
        if hit_blocks and not isinstance(hit_blocks, GroupHit):
            raise RuntimeError("a grouped KV manager takes the prefix hits its find_prefix_hit made")
        h = len(hit_blocks) if hit_blocks else 0
        hit = hit_blocks.groups if isinstance(hit_blocks, GroupHit) else [[] for _ in self.windows]
        skips = [self._out_of_window(g, h * self.block_size) for g in range(self.num_groups)]
        shared = [hit[g][skips[g] : h] for g in range(self.num_groups)]
        total = cdiv(req.num_computed_tokens + h * self.block_size + num_new_tokens, self.block_size)
        fresh = [max(0, total - len(t) - h) for t in tables]
        wanted = sum(fresh) + sum(self.pool.num_free_among(s) for s in shared)  # type: ignore[arg-type]
        if wanted > self.pool.num_free_blocks:
            return False
        if h:
            for g, table in enumerate(tables):  # shared before allocating: the fresh ones cannot evict them
                self.pool.share(shared[g])  # type: ignore[arg-type]
                table.extend(0 if b is None else b for b in hit[g])  # placeholders: any valid block
                req.group_released[g] = skips[g]
            req.num_released_blocks = skips[0]
            req.num_computed_tokens += h * self.block_size
            req.num_cached_blocks = h
        for g, table in enumerate(tables):
            if fresh[g]:
                got = self.pool.allocate(fresh[g])
                if got is None:  # cannot happen after the check above
                    raise RuntimeError("KV block pool refused an allocation it had room for")
                table.extend(got)
        return True

    def cache_computed_blocks(self, req: Request, num_computed: int | None = None) -> None:
        """Register every group's blocks now full of computed tokens, each under its group's key."""
        first = req.num_cached_blocks
        super().cache_computed_blocks(req, num_computed)
        if req.group_block_ids is None or req.num_cached_blocks <= first:
            return
        bs = self.block_size
        for g in range(1, self.num_groups):
            table = req.group_block_ids[g]
            for i in range(first, req.num_cached_blocks):
                self.pool.cache_block(table[i], group_key(req.block_hashes[i], g), req.token_ids[i * bs : (i + 1) * bs],
                                      announce=False)  # fmt: skip

    def free(self, req: Request) -> None:
        """Release every group's held blocks (not released placeholders)."""
        groups = req.group_block_ids
        if groups is not None:
            for g in range(1, len(groups)):
                held = groups[g][req.group_released[g] :]
                if held:
                    self.pool.free(held)
        req.group_block_ids = None
        req.group_released = []
        super().free(req)

    # -- stats --------------------------------------------------------------------------
    def blocks_held_by_group(self, requests: Iterable[Request]) -> tuple[int, ...]:
        """Distinct pool blocks each group's tables hold a reference on, over ``requests``."""
        held: list[set[int]] = [set() for _ in self.windows]
        for req in requests:
            if req.group_block_ids is not None:
                for g, table in enumerate(req.group_block_ids):
                    held[g].update(table[req.group_released[g] :])
        return tuple(len(s) for s in held)

    def group_names(self) -> tuple[str, ...]:
        """A label per group: ``full-0``, ``sliding128-1``... (its kind and index)."""
        return tuple(f"full-{g}" if w is None else f"sliding{w}-{g}" for g, w in enumerate(self.windows))
