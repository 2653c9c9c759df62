"""Penalty state on the logits' device: each penalized request's distinct tokens and their counts.

Owns what repetition, frequency and presence penalties need to know about a request's tokens.
Like vLLM, the state lives on the logits' device, is filled once per request and is then updated
there from each step's sampled ids, so no step re-reads a prompt on the host; unlike vLLM's dense
``[requests, vocab]`` masks, a request's row is the list of its distinct tokens (the prompt's
when it has a repetition penalty, then its outputs' as they appear) with each one's output
count, so a step's work follows the rows' tokens, never ``rows x vocab`` (the CPU device does
this work too):

* ``ids`` ``[slots, width]`` int64, ``counts`` ``[slots, width]`` float32 (0 for a prompt-only
  token) and ``num`` ``[slots]`` int64 (the valid entries) on the device; the host keeps only
  an upper bound of each row's ``num`` (exact at a fill, +1 per recorded token), which sizes
  the slices a step touches and the pool's ``width`` (doubled when a row outgrows it);
* :meth:`PenaltyPool.apply`: one gather of the rows' entries, the penalties, one write back
  (entries past ``num`` repeat entry 0, which computes and writes the same value);
* :meth:`PenaltyPool.record`: the step's sampled ids, from the sampled token tensor, matched
  against each row's entries on the device: a count goes up, or the id is appended. Async
  scheduling's placeholders never need their values here.

The pool also shrinks: a burst of penalized requests, or one request whose penalty history spans
the vocabulary, would otherwise keep the peak ``[slots, width]`` for ever. When requests have left
and the live rows fit in a quarter of the slots, or the widest live row in a quarter of the width
(both above their floors), :meth:`PenaltyPool.prepare` copies the live rows into smaller tensors
(twice what they need, so a pool never shrinks and regrows at once) and renumbers their slots.
That is the one safe point: a step's :class:`PenaltyRows` (slot numbers) live from its
``prepare`` to its ``record``, and each step runs them in that order on one thread (the sampler's,
one step after another) before the next step prepares; a step's rows carry the pool's ``epoch``,
which every compaction bumps, and are refused when stale.

Correctness does not hang on every step being recorded: each :class:`RequestPenalties` counts
the output tokens its row holds (``num_counted``), and a row whose request has another number of
output tokens (tokens accepted by speculative verification, which does not sample here, or a
failed step's token dropped and sampled again) is filled again from the host. Rows are freed
when the request leaves (:meth:`RequestPenalties.release`, called by the output processor on the
engine thread, possibly while the step worker samples: the free list is locked, and a slot freed
during a step is only handed out again by a later step).

Knows nothing about scheduling, grammars or the model.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inflight.runtime.worker.batched_sampling import id_array, row_index, upload

if TYPE_CHECKING:
    from inflight.runtime.worker.sampler import SamplingRow

_MIN_SLOTS = 8
_MIN_WIDTH = 64


class RequestPenalties:
    """One penalized request's row in a :class:`PenaltyPool` (none until its first sampled step).
    Created with the request's output state; :meth:`release` when the request leaves."""

    __slots__ = ("pool", "slot", "num_counted", "bound", "released")

    def __init__(self) -> None:
        self.pool: PenaltyPool | None = None
        self.slot: int | None = None
        self.num_counted = 0  # output tokens the row holds
        self.bound = 0  # at least the row's number of entries (``num`` on the device)
        self.released = False

    def release(self) -> None:
        """Give the row back (the request has left); the state is never used again."""
        if self.pool is None:
            self.released = True
            return
        self.pool.free(self)


@dataclass(frozen=True, slots=True)
class PenaltyRows:
    """The rows of one step that use the pool: ``rows[j]`` (a row of the step's logits) is in
    ``slots[j]`` of the pool, ``holders[j]`` its request's state."""

    rows: tuple[int, ...]
    slots: tuple[int, ...]
    holders: tuple[RequestPenalties, ...]
    epoch: int = 0  # the pool's epoch at prepare(): slot numbers hold until the next compaction


class PenaltyPool:
    """The penalized requests' rows on one device, grown on demand (doubling), reused once freed,
    compacted when far fewer or far narrower rows are live (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lock = threading.Lock()  # the free list: released on the engine thread, used on the sampler's
        self.ids = torch.zeros((0, _MIN_WIDTH), dtype=torch.int64, device=device)  # [slots, width]
        self.counts = torch.zeros((0, _MIN_WIDTH), dtype=torch.float32, device=device)  # [slots, width]
        self.num = torch.zeros(0, dtype=torch.int64, device=device)  # [slots] valid entries
        self._free: list[int] = []
        self._holders: dict[int, RequestPenalties] = {}  # slot -> its live row's holder
        self._freed = False  # a row was freed since the last look at shrinking
        self.epoch = 0  # bumped by each compaction (slot numbers change)

    @property
    def capacity(self) -> int:
        return self.ids.shape[0]

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def free(self, holder: RequestPenalties) -> None:
        with self.lock:
            if holder.slot is not None and not holder.released:
                self._free.append(holder.slot)
                del self._holders[holder.slot]
                self._freed = True
            holder.slot, holder.released = None, True

    # -- a step -------------------------------------------------------------------------
    def prepare(self, rows: Sequence[SamplingRow], index: Sequence[int]) -> PenaltyRows:
        """Bring the state of ``rows[i]`` for ``i`` in ``index`` up to date (a new request's row
        filled, a row whose output count is not its request's filled again), without a host
        sync; the rows of a released request are left out (their token lists serve)."""
        fills: list[tuple[RequestPenalties, SamplingRow, int]] = []
        kept_rows: list[int] = []
        holders: list[RequestPenalties] = []
        slots: list[int] = []
        with self.lock:
            if self._freed:
                self._freed = False
                self._shrink()
            for i in index:
                row = rows[i]
                h = row.penalties
                if h is None or h.released:
                    continue
                if h.slot is None:
                    h.pool, h.slot = self, self._allocate()
                    self._holders[h.slot] = h
                    fills.append((h, row, h.slot))
                elif h.num_counted != len(row.output_token_ids):
                    fills.append((h, row, h.slot))
                kept_rows.append(i)
                holders.append(h)
                slots.append(h.slot)  # read under the lock: a release may clear h.slot any time
            epoch = self.epoch
        if fills:
            with torch.inference_mode():
                self._fill(fills)
        return PenaltyRows(tuple(kept_rows), tuple(slots), tuple(holders), epoch)

    def apply(self, logits: torch.Tensor, at: PenaltyRows, rows: Sequence[SamplingRow]) -> None:
        """Repetition (each row's entries), then frequency and presence (entries with an output
        count) penalties of the rows ``at``, in place: one gather and one write of their logits."""
        use = [j for j, h in enumerate(at.holders) if h.bound > 0]  # a row with no entry has nothing to do
        if not use:
            return
        self._check_epoch(at)
        dev = logits.device
        params = [rows[at.rows[j]].params for j in use]
        width = max(at.holders[j].bound for j in use)
        slots = row_index([at.slots[j] for j in use], self.device)
        with torch.inference_mode():
            ids = self.ids[:, :width].index_select(0, slots)  # [k, width]
            counts = self.counts[:, :width].index_select(0, slots)
            valid = torch.arange(width, device=dev)[None, :] < self.num.index_select(0, slots)[:, None]
            ids = torch.where(valid, ids, ids[:, :1])  # past ``num``: entry 0 again (the same value)
            counts = torch.where(valid, counts, counts[:, :1])
            whole = len(use) == logits.shape[0] and all(at.rows[j] == j for j in use)
            at_logits = None if whole else (row_index([at.rows[j] for j in use], dev)[:, None], ids)
            vals = logits.gather(1, ids) if at_logits is None else logits[at_logits]  # [k, width]
            if any(p.repetition_penalty != 1.0 for p in params):
                r = upload(np.asarray([p.repetition_penalty for p in params], dtype=np.float32), dev)
                r = r.to(logits.dtype)[:, None]
                vals = torch.where(vals > 0, vals / r, vals * r)  # r == 1 leaves a row as it is
            if any(p.frequency_penalty or p.presence_penalty for p in params):
                fp = upload(np.asarray([(p.frequency_penalty, p.presence_penalty) for p in params],
                                       dtype=np.float32), dev).to(logits.dtype)  # fmt: skip
                c = counts.to(logits.dtype)
                vals = torch.where(counts > 0, vals - (fp[:, :1] * c + fp[:, 1:]), vals)
            if at_logits is None:
                logits.scatter_(1, ids, vals)
            else:
                logits[at_logits] = vals

    def record(self, at: PenaltyRows, token_ids: torch.Tensor, skip: frozenset[int] = frozenset()) -> None:
        """Count the step's sampled ids (``token_ids`` ``[num_rows]`` on the device) in the rows
        ``at``, on the device: an entry's count goes up, or the id becomes a new entry; ``skip``:
        rows that drew no token (deferred)."""
        keep = [j for j, i in enumerate(at.rows) if i not in skip]
        if not keep:
            return
        holders = [at.holders[j] for j in keep]
        width = max(h.bound for h in holders) + 1
        with self.lock:
            self._check_epoch(at)
            self._widen(width)
        with torch.inference_mode():
            slots = row_index([at.slots[j] for j in keep], self.device)
            tokens = token_ids.index_select(0, row_index([at.rows[j] for j in keep], token_ids.device))  # [k]
            num = self.num.index_select(0, slots)  # [k]
            valid = torch.arange(width, device=self.device)[None, :] < num[:, None]
            match = (self.ids[:, :width].index_select(0, slots) == tokens[:, None]) & valid  # [k, width]
            found = match.any(dim=-1)
            pos = torch.where(found, match.to(torch.uint8).argmax(dim=-1), num)
            old = self.counts[slots, pos]
            self.counts[slots, pos] = torch.where(found, old + 1.0, torch.ones_like(old))
            self.ids[slots, pos] = tokens
            self.num.index_copy_(0, slots, num + (~found).to(torch.int64))
        for h in holders:
            h.num_counted += 1
            h.bound += 1

    # -- inside -------------------------------------------------------------------------
    def _check_epoch(self, at: PenaltyRows) -> None:
        if at.epoch != self.epoch:  # an internal invariant: see the module docstring
            raise RuntimeError("penalty rows prepared before the pool was compacted were used after it")

    def _shrink(self) -> None:
        """Compact the live rows into smaller tensors when they fit a quarter of the slots or
        of the width (above the floors); the caller holds the lock, and no step's rows are live."""
        live = sorted(self._holders.items())  # (slot, holder), lowest slot first
        capacity, width = self.capacity, self.ids.shape[1]
        need = max([h.bound for _, h in live] + [1])  # the widest live row, at most
        new_capacity = _halved_to(len(live), capacity, _MIN_SLOTS)
        new_width = _halved_to(need, width, _MIN_WIDTH)
        if new_capacity == capacity and new_width == width:
            return
        with torch.inference_mode():
            old = row_index([slot for slot, _ in live], self.device)
            self.ids = _grown(self.ids[:, :new_width].index_select(0, old), new_capacity, new_width)
            self.counts = _grown(self.counts[:, :new_width].index_select(0, old), new_capacity, new_width)
            self.num = _grown(self.num.index_select(0, old), new_capacity)
        self._holders = {}
        for slot, (_, h) in enumerate(live):
            h.slot = slot
            self._holders[slot] = h
        self._free = list(range(new_capacity - 1, len(live) - 1, -1))  # the lowest first
        self.epoch += 1

    def _allocate(self) -> int:
        """A free slot (growing the pool when there is none); the caller holds the lock."""
        if not self._free:
            old, new = self.capacity, max(_MIN_SLOTS, 2 * self.capacity)
            with torch.inference_mode():
                self.ids = _grown(self.ids, new, self.ids.shape[1])
                self.counts = _grown(self.counts, new, self.counts.shape[1])
                self.num = _grown(self.num, new)
            self._free.extend(range(new - 1, old - 1, -1))  # the lowest first
        return self._free.pop()

    def _widen(self, width: int) -> None:
        """Room for ``width`` entries a row (doubling); the caller holds the lock."""
        if width > self.ids.shape[1]:
            new = max(width, 2 * self.ids.shape[1])
            with torch.inference_mode():
                self.ids = _grown(self.ids, self.capacity, new)
                self.counts = _grown(self.counts, self.capacity, new)

    def _fill(self, fills: list[tuple[RequestPenalties, SamplingRow, int]]) -> None:
        """Each row's entries (in its slot) from its request's tokens on the host (one write per tensor)."""
        entries = [_entries(row) for _, row, _ in fills]
        with self.lock:
            self._widen(max([len(ids) for ids, _ in entries] + [1]))
        for (h, row, _), (ids, _) in zip(fills, entries, strict=True):
            h.num_counted, h.bound = len(row.output_token_ids), len(ids)
        dev = self.device
        slots = np.asarray([slot for _, _, slot in fills], dtype=np.int64)
        num = np.asarray([len(ids) for ids, _ in entries], dtype=np.int64)
        self.num.index_copy_(0, upload(slots, dev), upload(num, dev))
        filled = [(s, ids, c) for s, (ids, c) in zip(slots, entries, strict=True) if len(ids)]
        if filled:
            at = (upload(np.concatenate([np.full(len(ids), s, dtype=np.int64) for s, ids, _ in filled]), dev),
                  upload(np.concatenate([np.arange(len(ids), dtype=np.int64) for _, ids, _ in filled]), dev))  # fmt: skip
            self.ids.index_put_(at, upload(np.concatenate([ids for _, ids, _ in filled]), dev))
            self.counts.index_put_(at, upload(np.concatenate([c for _, _, c in filled]), dev))


def _entries(row: SamplingRow) -> tuple[np.ndarray, np.ndarray]:
    """A row's distinct tokens (the prompt's too under a repetition penalty) and their output
    counts, from its token lists (float32 counts; 0 for a prompt-only token)."""
    out = id_array(row.output_token_ids)
    assert not len(out) or out.min() >= 0, "a placeholder token reached the penalty state's host path"
    ids, counts = np.unique(out, return_counts=True)
    if row.params.repetition_penalty == 1.0:
        return ids, counts.astype(np.float32)
    every = np.union1d(np.unique(id_array(row.prompt_token_ids)), ids)
    full = np.zeros(len(every), dtype=np.float32)
    full[np.searchsorted(every, ids)] = counts
    return every, full


def _halved_to(used: int, size: int, floor: int) -> int:
    """``size`` while ``used`` takes more than a quarter of it (or it is at ``floor``); else the
    smallest ``floor * 2**k`` that holds twice ``used``."""
    if size <= floor or 4 * used > size:
        return size
    new = floor
    while new < 2 * used:
        new *= 2
    return min(new, size)


def _grown(t: torch.Tensor, rows: int, cols: int | None = None) -> torch.Tensor:
    """``t`` copied into a zeroed tensor of ``rows`` (x ``cols``)."""
    out = torch.zeros((rows,) if cols is None else (rows, cols), dtype=t.dtype, device=t.device)
    if cols is None:
        out[: t.shape[0]] = t
    else:
        out[: t.shape[0], : t.shape[1]] = t
    return out
