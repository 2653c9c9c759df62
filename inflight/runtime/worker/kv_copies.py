"""The host tier's bytes (``kv_offloading_size``): a second KV pool in host memory, and the step's
block copies between it and the device's paged KV cache.

:class:`HostKV` holds, for every cache indexed by the scheduler's block tables (the served
model's and a draft model's, :mod:`inflight.runtime.spec_decode.draft_proposer`), one host
tensor per layer and K/V of shape ``[num_slots, block_size, num_kv_heads, head_dim]``, all views
of one allocation (:class:`~inflight.runtime.worker.host_arena.HostArena`, page-locked on CUDA as
one range: the bytes pinned are the pool's, not each layer's rounded up to a power of two).
:meth:`HostKV.run` runs one step's :class:`~inflight.runtime.core.sched_output.KVCopies`
before that step's forward, on the thread that runs the forward (the engine thread, or the
async pipeline's :class:`~inflight.runtime.worker.step_worker.StepWorker`), every copy-out
first, then every copy-in (the order :mod:`inflight.runtime.core.host_tier` relies on).

On CUDA the copies are queued on the current (compute) stream, ``non_blocking`` from and into
pinned memory: the stream orders them after the step before (whose forward may still read a
block being saved) and before this step's forward (which may overwrite it), so no event is
waited for and the host never syncs; runs of consecutive blocks go as one copy. The host
tensors are only ever read or written by the stream, never by the CPU. On the CPU the two pools
are ordinary tensors and a step's copies are two gathers per layer.

:class:`SimHostKV` is the simulated device's (``--device sim``): no tensors; it counts the
copies and their bytes and holds the thread for the modelled transfer time, counted as busy.
Which blocks move is the core's (:mod:`inflight.runtime.core.host_tier`); this module knows
nothing about keys, requests or scheduling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from inflight.runtime.core.sched_output import KVCopies
from inflight.runtime.worker.host_arena import HostArena

logger = logging.getLogger(__name__)

GIB = 1 << 30
KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V [num_blocks, block_size, heads, head_dim]


def num_host_slots(size_gib: float, bytes_per_block: int) -> int:
    """Host blocks that ``size_gib`` GiB hold, each ``bytes_per_block`` (every layer, K and V, of
    every cache indexed by the block tables); raises ``ValueError`` when not even one fits."""
    if bytes_per_block <= 0:
        raise ValueError("the KV cache has no bytes per block to offload")
    num = int(size_gib * GIB) // bytes_per_block
    if num < 1:
        raise ValueError(f"kv_offloading_size {size_gib} GiB holds no KV block ({bytes_per_block} bytes each); "
                         f"give at least {bytes_per_block / GIB:.6f} GiB.")
    return num


class _CopyCounts:
    """What both host pools report: their size, and the blocks and bytes they have copied."""

    def __init__(self, num_slots: int, bytes_per_block: int) -> None:
        self.num_slots = num_slots
        self.bytes_per_block = bytes_per_block
        self.num_copied_out = 0  # blocks
        self.num_copied_in = 0
        self.num_copied_bytes = 0

    @property
    def host_bytes(self) -> int:
        return self.num_slots * self.bytes_per_block

    def _count(self, copies: KVCopies) -> int:
        """Count ``copies`` as done; returns their bytes."""
        num_bytes = copies.num_blocks * self.bytes_per_block
        self.num_copied_out += len(copies.copy_out)
        self.num_copied_in += len(copies.copy_in)
        self.num_copied_bytes += num_bytes
        return num_bytes


class HostKV(_CopyCounts):
    """The host pool of every cache in ``caches`` (see module docstring)."""

    def __init__(self, caches: Sequence[KVCaches], num_slots: int) -> None:
        if not caches or not all(caches):
            raise ValueError("the host tier needs allocated KV caches")
        self.device = caches[0][0][0].device
        # every layer's K and V of every cache; an fp8 cache moves as bytes (no fp8 gathers on the CPU)
        devs = [t.view(torch.uint8) if t.element_size() == 1 else t for cache in caches for kv in cache for t in kv]
        self.arena = HostArena([(num_slots, *t.shape[1:]) for t in devs], [t.dtype for t in devs],
                               self.device if self.device.type == "cuda" else None)  # fmt: skip
        self._pairs = list(zip(devs, self.arena.views, strict=True))  # (device, host), one per layer and K/V
        super().__init__(num_slots, sum(h[0].numel() * h.element_size() for _, h in self._pairs))

    def run(self, copies: KVCopies) -> None:
        """Every copy-out (device block -> host slot), then every copy-in (slot -> block)."""
        if self.device.type == "cuda":
            self._run_cuda(copies)
        else:
            self._run_cpu(copies)
        self._count(copies)

    def _run_cpu(self, copies: KVCopies) -> None:
        if copies.copy_out:
            blocks = torch.tensor([b for b, _ in copies.copy_out], dtype=torch.long)
            slots = torch.tensor([s for _, s in copies.copy_out], dtype=torch.long)
            for dev, host in self._pairs:
                host.index_copy_(0, slots, dev.index_select(0, blocks))
        if copies.copy_in:
            slots = torch.tensor([s for s, _ in copies.copy_in], dtype=torch.long)
            blocks = torch.tensor([b for _, b in copies.copy_in], dtype=torch.long)
            for dev, host in self._pairs:
                dev.index_copy_(0, blocks, host.index_select(0, slots))

    def _run_cuda(self, copies: KVCopies) -> None:
        for src, dst, n in _runs(copies.copy_out):
            for dev, host in self._pairs:
                host[dst : dst + n].copy_(dev[src : src + n], non_blocking=True)
        for src, dst, n in _runs(copies.copy_in):
            for dev, host in self._pairs:
                dev[dst : dst + n].copy_(host[src : src + n], non_blocking=True)


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(src, dst)`` pairs as ``(src, dst, n)`` runs of consecutive sources and destinations."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


class SimHostKV(_CopyCounts):
    """The simulated device's host tier: counts copies and bytes; ``busy(seconds)`` is told the
    modelled transfer time (``bytes / host_copy_gb_per_s``), which it waits out."""

    def __init__(self, num_slots: int, bytes_per_block: int, gb_per_s: float,
                 busy: Callable[[float], None]) -> None:
        super().__init__(num_slots, bytes_per_block)
        self._gb_per_s = gb_per_s
        self._busy = busy

    def run(self, copies: KVCopies) -> None:
        num_bytes = self._count(copies)
        seconds = num_bytes / (self._gb_per_s * 1e9) if self._gb_per_s > 0 else 0.0
        start = time.monotonic()
        if seconds > 0:
            time.sleep(seconds)
        self._busy(time.monotonic() - start)
