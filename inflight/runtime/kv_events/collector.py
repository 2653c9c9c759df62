"""KVEventCollector: what the block pool's prefix cache and its host tier gained and lost during
one engine step.

The pool calls :meth:`stored` when a full block becomes findable under its hash, :meth:`removed`
when a hash stops being findable (eviction) and :meth:`cleared` on a reset that empties the
cache; the host tier (``kv_offloading_size``) calls :meth:`host_stored` / :meth:`host_removed`
(medium ``"CPU"``) when it takes or drops a block. The engine :meth:`take`\\ s the step's
events once per step and hands them to the publisher.

Events are merged so a step sends few: a store that continues the chain of an open device
``BlockStored`` (same adapter) joins it, as vLLM sends a request's newly full blocks together; a
host store joins the step's open host ``BlockStored``; a removal joins the open ``BlockRemoved``
of its medium. Merging moves an event earlier, so it is done only when no event after the one
joined mentions any of its hashes (in any medium): each hash's own story stays in order, and a
host store never overtakes the device store that told a router what the block holds.
Imports no torch and no sockets; knows nothing about requests or scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence

from inflight.runtime.kv_events.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_hash,
)


class KVEventCollector:
    """Events of the current step, in the order the pool and its tier changed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []
        self._open: dict[tuple[type, str | None], int] = {}  # (event type, medium) -> index a new one may join
        self._last_touch: dict[int, int] = {}  # hash -> index of the last event that mentions it

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int],
               lora_id: int | None = None, lora_name: str | None = None) -> None:
        """``block_hash`` (holding ``token_ids``) is findable in the device pool; ``parent_hash``:
        None for a chain's first."""
        h = external_hash(block_hash)
        parent = None if parent_hash is None else external_hash(parent_hash)
        at = self._joinable(BlockStored, MEDIUM_GPU, h)
        tail = self._events[at] if at is not None else None
        if (isinstance(tail, BlockStored) and parent is not None and tail.block_hashes[-1] == parent
                and tail.lora_id == lora_id and tail.lora_name == lora_name):
            self._replace(at, BlockStored(tail.block_hashes + (h,), tail.parent_block_hash,
                                          tail.token_ids + tuple(token_ids), self.block_size, lora_id,
                                          MEDIUM_GPU, lora_name), h)
            return
        self._append(BlockStored((h,), parent, tuple(token_ids), self.block_size, lora_id, MEDIUM_GPU, lora_name), h)

    def host_stored(self, block_hash: bytes) -> None:
        """The host tier took a copy of ``block_hash`` (medium ``"CPU"``). Sent as vLLM's
        offloading connector sends it: hashes only (no tokens, ``block_size`` 0, no parent), which
        a router resolves through the device store it saw earlier."""
        h = external_hash(block_hash)
        at = self._joinable(BlockStored, MEDIUM_CPU, h)
        if at is not None:
            tail = self._events[at]
            assert isinstance(tail, BlockStored)
            self._replace(at, BlockStored(tail.block_hashes + (h,), None, (), 0, None, MEDIUM_CPU), h)
            return
        self._append(BlockStored((h,), None, (), 0, None, MEDIUM_CPU), h)

    def host_removed(self, block_hash: bytes) -> None:
        """The host tier dropped ``block_hash`` (its LRU eviction, or a reset)."""
        self.removed(block_hash, MEDIUM_CPU)

    def removed(self, block_hash: bytes, medium: str = MEDIUM_GPU) -> None:
        """``block_hash`` is no longer findable in ``medium``."""
        h = external_hash(block_hash)
        at = self._joinable(BlockRemoved, medium, h)
        if at is not None:
            tail = self._events[at]
            assert isinstance(tail, BlockRemoved)
            self._replace(at, BlockRemoved(tail.block_hashes + (h,), medium), h)
            return
        self._append(BlockRemoved((h,), medium), h)

    def cleared(self) -> None:
        """Every block left the cache, in every tier: what came before this step no longer matters."""
        self._events = [AllBlocksCleared()]
        self._open.clear()
        self._last_touch.clear()

    def take(self) -> tuple[KVCacheEvent, ...]:
        """The step's events, oldest first; the collector starts empty again."""
        events = tuple(self._events)
        self._events, self._open, self._last_touch = [], {}, {}
        return events

    def __len__(self) -> int:
        return len(self._events)

    def _joinable(self, kind: type, medium: str | None, h: int) -> int | None:
        """The open event of ``kind`` in ``medium`` that ``h`` may join, or None (none open, or a
        later event mentions ``h``)."""
        at = self._open.get((kind, medium))
        if at is None or self._last_touch.get(h, -1) > at:
            return None
        return at

    def _replace(self, at: int, event: BlockStored | BlockRemoved, h: int) -> None:
        self._events[at] = event
        self._last_touch[h] = at

    def _append(self, event: BlockStored | BlockRemoved, h: int) -> None:
        self._events.append(event)
        at = len(self._events) - 1
        self._open[(type(event), event.medium)] = at
        self._last_touch[h] = at
