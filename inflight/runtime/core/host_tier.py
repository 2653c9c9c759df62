"""The host tier behind the prefix cache (``kv_offloading_size``): slots of host memory that keep
the full, hashed blocks the device pool evicts, so a prefix hit there is a copy, not a recompute.

Bookkeeping only: which host slot holds which block (the same chained key as the device cache,
:mod:`.block_pool`, and a check of the block's own token ids on a hit), least-recently-used
order over the slots, and the copies the step must run. The bytes live on the worker
(:mod:`inflight.runtime.worker.kv_copies`), which runs a step's copies before its forward:
every copy-out, then every copy-in (:class:`~inflight.runtime.core.sched_output.KVCopies`).

Rules that keep the copies exact:

* the tier is inclusive: a block brought back to the device stays in its slot, so when the
  device evicts it again nothing is copied (its key is found here, and only touched);
* a slot read by a copy-in of the step being planned is pinned until that step's copies are
  taken (:meth:`HostTier.take_copies`): a later eviction in the same step cannot reuse it, since
  its copy-out would run first and overwrite what the copy-in reads;
* two copy-outs into one slot in one step (the first's entry was evicted from the tier in that
  step, before anyone could load it) keep the last one only.

When every slot is pinned, an evicted device block is dropped (counted), never waited for.
With KV events on, each block the tier takes and each it drops is told to the collector
(``events``), medium ``"CPU"``, as vLLM's offloading connector does.
Imports no torch; knows nothing about requests or scheduling.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from inflight.runtime.core.sched_output import KVCopies

if TYPE_CHECKING:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.kv_events.collector import KVEventCollector
    from inflight.runtime.worker.kv_copies import HostKV, SimHostKV
    from inflight.runtime.worker.model_runner import ModelRunner
    from inflight.runtime.worker.sim_device import SimRunner

logger = logging.getLogger("inflight.engine")
BlockHash = bytes


def build_host_tier(
    config: EngineConfig, runner: ModelRunner | SimRunner, beside: Sequence[ModelRunner], window: int | None,
    pooling: bool,
) -> tuple[HostTier, HostKV | SimHostKV] | None:
    """The host tier and its pool for ``config.kv_offloading_size`` (None when unset): slots for
    as many blocks as the size holds, each block counted over every layer of ``runner``'s cache
    and ``beside``'s (a draft model's). Raises ``ValueError`` where the tier cannot work: a
    model whose every layer is windowed (``window``: its blocks are released, not cached whole)
    or a pooling engine."""
    size = config.kv_offloading_size
    if size is None:
        return None
    if pooling:
        raise ValueError("kv_offloading_size is for generate engines; this model is served by the pooling runner")
    if window is not None:
        raise ValueError(f"kv_offloading_size does not work with a model whose every layer attends within a "
                         f"window of {window} tokens (blocks before the window are released); drop it")
    host_kv = runner.host_kv(size, tuple(beside))  # type: ignore[arg-type]
    logger.info("host KV tier: %d blocks (%.2f GiB of %d-byte blocks)", host_kv.num_slots,
                host_kv.host_bytes / 2**30, host_kv.bytes_per_block)
    return HostTier(host_kv.num_slots), host_kv


class HostTier:
    """``num_slots`` host blocks, indexed by block key, evicted least-recently-used first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one block (got {num_slots}).")
        self.num_slots = num_slots
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # key -> slot, least recent first
        self.slot_hash: list[BlockHash | None] = [None] * num_slots
        self.slot_tokens: list[tuple[int, ...] | None] = [None] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._pinned: set[int] = set()
        self._copy_out: dict[int, int] = {}  # host slot -> device block (insertion order kept)
        self._copy_in: list[tuple[int, int]] = []  # (host slot, device block)
        # Cumulative figures (the metrics): tokens looked up past the device hits and found here,
        # blocks saved and loaded, blocks the tier evicted, and evicted device blocks it dropped.
        self.queries = 0
        self.hits = 0
        self.num_saved_blocks = 0
        self.num_loaded_blocks = 0
        self.num_evicted_blocks = 0
        self.num_dropped_blocks = 0
        self.events: KVEventCollector | None = None  # told each block taken and dropped (kv_events, "CPU")

    @property
    def num_used_slots(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def save(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """The device pool evicts ``block_id`` (full, keyed ``block_hash``): keep a copy."""
        slot = self._lru.get(block_hash)
        if slot is not None:  # brought back earlier (the tier is inclusive) or saved twice: no copy
            self._lru.move_to_end(block_hash)
            return
        slot = self._free.pop() if self._free else self._evict_lru()
        if slot is None:
            self.num_dropped_blocks += 1
            return
        self._lru[block_hash] = slot
        self.slot_hash[slot] = block_hash
        self.slot_tokens[slot] = tuple(token_ids)
        self._copy_out.pop(slot, None)  # keeps the dict's order the order of the copies
        self._copy_out[slot] = block_id
        self.num_saved_blocks += 1
        if self.events is not None:
            self.events.host_stored(block_hash)

    def find(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], block_size: int,
             start: int) -> list[int]:
        """Slots of the longest run of blocks ``start, start + 1, ...`` of ``block_hashes`` held
        here with ``token_ids``' own tokens (changes nothing)."""
        slots = []
        for i in range(start, len(block_hashes)):
            slot = self._lru.get(block_hashes[i])
            if slot is None or self.slot_tokens[slot] != tuple(token_ids[i * block_size : (i + 1) * block_size]):
                break
            slots.append(slot)
        return slots

    def pin(self, slots: Sequence[int]) -> None:
        """Keep ``slots`` from being reused until this step's copies are taken."""
        self._pinned.update(slots)

    def load(self, slots: Sequence[int], block_ids: Sequence[int]) -> None:
        """Copy ``slots`` into the fresh device blocks ``block_ids`` before this step's forward
        (pins them; they stay here too)."""
        for slot, block_id in zip(slots, block_ids, strict=True):
            h = self.slot_hash[slot]
            if h is None:
                raise RuntimeError(f"host slot {slot} holds no block")
            self._lru.move_to_end(h)
            self._copy_in.append((slot, block_id))
        self._pinned.update(slots)
        self.num_loaded_blocks += len(slots)

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_query_tokens
        self.hits += num_hit_tokens

    def take_copies(self) -> KVCopies | None:
        """The copies planned since the last call (None: none), and the pins released."""
        self._pinned.clear()
        if not self._copy_out and not self._copy_in:
            return None
        copies = KVCopies(tuple((b, s) for s, b in self._copy_out.items()), tuple(self._copy_in))
        self._copy_out.clear()
        self._copy_in.clear()
        return copies

    def clear(self) -> None:
        """Forget every block (a prefix-cache reset); copies already planned still run."""
        for slot, h in enumerate(self.slot_hash):
            if h is not None and slot not in self._pinned:
                del self._lru[h]
                self.slot_hash[slot] = self.slot_tokens[slot] = None
                self._free.append(slot)
                if self.events is not None:
                    self.events.host_removed(h)

    def _evict_lru(self) -> int | None:
        """The least recently used slot not pinned, emptied; None when every slot is pinned."""
        for h, slot in self._lru.items():
            if slot not in self._pinned:
                del self._lru[h]
                self.slot_hash[slot] = self.slot_tokens[slot] = None
                self.num_evicted_blocks += 1
                if self.events is not None:
                    self.events.host_removed(h)
                return slot
        return None

    def check_invariants(self) -> None:
        """Internal consistency, for tests: the index, the slots and the free list agree."""
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
        assert not set(self._free) & set(self._lru.values()), "a free slot is indexed"
        assert len(self._free) + len(self._lru) == self.num_slots, "slots leaked"
        for h, slot in self._lru.items():
            assert self.slot_hash[slot] == h and self.slot_tokens[slot] is not None, f"slot {slot} disagrees"
        for slot in self._free:
            assert self.slot_hash[slot] is None and self.slot_tokens[slot] is None, f"free slot {slot} holds a block"
