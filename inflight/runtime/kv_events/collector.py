"""KVEventCollector: what the block pool's prefix cache gained and lost during one engine step.

The pool calls :meth:`stored` when a full block becomes findable under its hash, :meth:`removed`
when a hash stops being findable (eviction) and :meth:`cleared` on a reset that empties the
cache; the engine :meth:`take`\\ s the step's events once per step and hands them to the
publisher. Consecutive stores that continue one chain (same adapter) are merged into one
``BlockStored``, as vLLM sends a request's newly full blocks together. Imports no torch and no
sockets; knows nothing about requests or scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence

from inflight.runtime.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_hash,
)


class KVEventCollector:
    """Events of the current step, in the order the pool changed."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []
        self._stored_tail: int | None = None  # index in _events of a BlockStored a store may extend

    def stored(self, block_hash: bytes, parent_hash: bytes | None, token_ids: Sequence[int],
               lora_id: int | None = None, lora_name: str | None = None) -> None:
        """``block_hash`` (holding ``token_ids``) is findable; ``parent_hash``: None for a chain's first."""
        h = external_hash(block_hash)
        parent = None if parent_hash is None else external_hash(parent_hash)
        tail = self._events[self._stored_tail] if self._stored_tail is not None else None
        if (isinstance(tail, BlockStored) and parent is not None and tail.block_hashes[-1] == parent
                and tail.lora_id == lora_id and tail.lora_name == lora_name):
            self._events[self._stored_tail] = BlockStored(
                tail.block_hashes + (h,), tail.parent_block_hash, tail.token_ids + tuple(token_ids),
                self.block_size, lora_id, tail.medium, lora_name)
            return
        self._events.append(BlockStored((h,), parent, tuple(token_ids), self.block_size, lora_id,
                                        lora_name=lora_name))
        self._stored_tail = len(self._events) - 1

    def removed(self, block_hash: bytes) -> None:
        """``block_hash`` is no longer findable (merged with the removal just before it)."""
        h = external_hash(block_hash)
        tail = self._events[-1] if self._events else None
        if isinstance(tail, BlockRemoved):
            self._events[-1] = BlockRemoved(tail.block_hashes + (h,), tail.medium)
        else:
            self._events.append(BlockRemoved((h,)))
        self._stored_tail = None

    def cleared(self) -> None:
        """Every block left the cache: what came before this step no longer matters."""
        self._events = [AllBlocksCleared()]
        self._stored_tail = None

    def take(self) -> tuple[KVCacheEvent, ...]:
        """The step's events, oldest first; the collector starts empty again."""
        events, self._events, self._stored_tail = tuple(self._events), [], None
        return events

    def __len__(self) -> int:
        return len(self._events)
