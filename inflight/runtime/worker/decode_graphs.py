"""Pure-decode steps on captured graphs: static buffers, capture sizes, padding, replay.

A step whose every sequence feeds one token (no prompt chunk) runs on a graph captured for
the next capture size up (``1, 2, 4, 8, 16, 32, 48, ...``, as vLLM and nano-vllm pad). The
graphs read fixed input buffers (token ids, positions, KV slots, a block table as wide as
``max_model_len`` needs, context lengths) and write fixed logits, so a step only copies its
inputs in, replays, and reads its rows back out. Padding rows feed token 0 at position 0,
write no KV (slot -1, which the KV store skips) and attend to one token of block 0 (never a
zero length, so the softmax stays finite); their logits are never read. The graphs are
captured once, largest first so the smaller ones reuse its memory, and every size writes its
float32 logits into rows of ONE buffer sized for the largest (a graph's own output would stay
alive beside the others': 5.1 GB at vocab 152k and 512 rows, against 0.3 GB shared;
:func:`logits_buffer_bytes`). With per-group KV tables (``num_groups``, :mod:`.kv_layout`) every
group's slots and block table get static buffers too (padding rows: slot -1 in each group). Knows nothing about
scheduling or sampling; the capture mechanics live in :mod:`inflight.runtime.worker.graph_backend`.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.worker.graph_backend import GraphBackend

logger = logging.getLogger(__name__)


@contextmanager
def collector_kept_out() -> Iterator[None]:
    """Collect what is garbage now, then keep the garbage collector out of a capture: what is
    alive is frozen (no pass scans it) and automatic passes are off until the block ends (a
    finalizer run inside a capture could free or sync a tensor and break it). A process that
    had frozen objects already (settled for serving, engine_core/process_gc.py; a capture can
    come mid-serving, once fp8 KV scales are set) stays frozen: unfreezing is all or nothing."""
    was_frozen = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        if not was_frozen:
            gc.unfreeze()

MAX_CAPTURE_SIZE = 512
# The model: (input_ids, positions, metadata) -> float32 logits [num_tokens, vocab].
LogitsFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_sequences: int, limit: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """``1, 2, 4, 8``, then every multiple of 16, up to ``max_num_sequences`` (capped at
    ``limit``; the top size is always included)."""
    top = max(1, min(max_num_sequences, limit))
    sizes = {s for s in (1, 2, 4, 8) if s <= top} | set(range(16, top + 1, 16)) | {top}
    return tuple(sorted(sizes))


def logits_buffer_bytes(sizes: tuple[int, ...], vocab_size: int, shared: bool = True) -> int:
    """Bytes of float32 logits the graphs keep: one ``[max(sizes), vocab]`` buffer when
    ``shared``, else one output per captured size (what each graph would hold on its own)."""
    rows = max(sizes, default=0) if shared else sum(sizes)
    return rows * vocab_size * 4


@dataclass(frozen=True, slots=True)
class DecodeGraphStats:
    sizes: tuple[int, ...]
    capture_seconds: float
    memory_bytes: int


class DecodeGraphs:
    """Captured pure-decode steps for a list of batch sizes, over one set of static buffers."""

    def __init__(
        self, logits_fn: LogitsFn, backend: GraphBackend, sizes: tuple[int, ...],
        max_blocks_per_seq: int, device: torch.device, num_groups: int = 0,
    ) -> None:  # fmt: skip
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one capture size")
        self.sizes = tuple(sorted(sizes))
        self.max_size = self.sizes[-1]
        self._logits_fn = logits_fn
        self.backend = backend
        n, dev = self.max_size, device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self._empty_tables = torch.zeros(0, 1, dtype=torch.int32, device=dev)
        self._empty_lens = torch.zeros(0, dtype=torch.int32, device=dev)
        self._query_start = torch.zeros(1, dtype=torch.int32, device=dev)
        # per-group KV tables: [num_groups, max_size] slots, [num_groups, max_size, max_blocks] tables
        self.group_slots = torch.full((num_groups, n), -1, dtype=torch.int64, device=dev) if num_groups else None
        self.group_tables = (torch.zeros(num_groups, n, max_blocks_per_seq, dtype=torch.int32, device=dev)
                             if num_groups else None)  # fmt: skip
        # [max_size, vocab] float32: every size's graph writes its rows (allocated by the largest
        # size's warm-up run, which runs before any capture: the vocab is the model's to know)
        self.logits_buffer: torch.Tensor | None = None
        self._replays: dict[int, Callable[[], None]] = {}
        self.stats: DecodeGraphStats | None = None

    def padded_size(self, num_seqs: int) -> int | None:
        """The capture size a step of ``num_seqs`` decodes runs at; None if too large."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def capture(self) -> DecodeGraphStats:
        """Capture every size (largest first); logs and returns the time and memory taken."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._replays[size] = self.backend.capture(self._step_fn(size))
        self.stats = DecodeGraphStats(self.sizes, time.perf_counter() - start, self.backend.memory_bytes())
        logger.info("captured %s graphs for decode batch sizes %s in %.1f s (%.0f MiB)",
                    self.backend.name, ",".join(map(str, self.sizes)), self.stats.capture_seconds,
                    self.stats.memory_bytes / 2**20)  # fmt: skip
        return self.stats

    def _meta(self, size: int) -> AttentionMetadata:
        groups = self.group_tables
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size], decode_context_lens=self.context_lens[:size],
            prefill_block_tables=self._empty_tables, prefill_query_start_loc=self._query_start,
            prefill_context_lens=self._empty_lens, num_prefills=0,
            group_slot_mapping=None if self.group_slots is None else self.group_slots[:, :size],
            group_decode_block_tables=None if groups is None else groups[:, :size],
            group_prefill_block_tables=None if groups is None else groups[:, :0],
        )  # fmt: skip

    def _step_fn(self, size: int) -> Callable[[], None]:
        meta = self._meta(size)

        def step() -> None:
            logits = self._logits_fn(self.input_ids[:size], self.positions[:size], meta)  # [size, vocab]
            if self.logits_buffer is None:
                if size != self.max_size:
                    raise RuntimeError("the decode graphs' logits buffer is allocated by the largest size, first")
                self.logits_buffer = torch.empty((self.max_size, *logits.shape[1:]), dtype=logits.dtype,
                                                 device=logits.device)  # fmt: skip
            self.logits_buffer[:size].copy_(logits)

        return step

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits ``[num_seqs, vocab]`` of a pure-decode step (a view of the shared logits
        buffer, valid until the next replay of any size)."""
        n = meta.num_decode_tokens
        size = self.padded_size(n)
        if size is None or meta.num_prefills or input_ids.shape[0] != n:
            raise ValueError(f"not a pure-decode step of at most {self.max_size} sequences")
        width = meta.decode_block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block table of {width} blocks exceeds the graphs' {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        if self.group_slots is not None and self.group_tables is not None:  # per-group KV tables
            if meta.group_slot_mapping is None or meta.group_decode_block_tables is None:
                raise ValueError("these decode graphs read per-group KV tables; the step has none")
            self.group_slots[:, :n].copy_(meta.group_slot_mapping, non_blocking=True)
            self.group_tables[:, :n, :width].copy_(meta.group_decode_block_tables, non_blocking=True)
            if size > n:
                self.group_slots[:, n:size].fill_(-1)
        if size > n:  # padding rows: no KV write, attend to one token
            self.slot_mapping[n:size].fill_(-1)
            self.context_lens[n:size].fill_(1)
        self._replays[size]()
        assert self.logits_buffer is not None  # allocated by the first capture
        return self.logits_buffer[:n]
