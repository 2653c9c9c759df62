"""CPU decode lanes: a pure-decode step split by rows over threads, one OpenMP thread each.

On a few CPU cores a decode step is ~100 small ops (norms, activations, attention, and
matmuls of a few rows); with an OpenMP team per op every op pays a fork and a join, and with
passive waits (which the server needs, see ``device_setup.cpu_thread_counts``) each join
wakes a sleeping thread. Decode rows do not interact inside a step, so the batch can be cut
in two (or more) lanes that each run the whole model on their rows in a thread of their own,
single-threaded: one join per step instead of one per op. The step ends when its slowest lane
does, so the rows are split by their estimated work, not their count: every row costs its
products, and its attention reads its whole context from the cache, so with contexts of 50 and
600 tokens an even count left one lane ~10% of the step idle (bench-medium, 24 rows). torch
and the native kernels drop the GIL while they compute, so the lanes run in parallel; between
calls a lane holds the GIL for its Python and may wait for the other lane's, so fewer
Python-level calls pay: on the native CPU kernels with MKL-packed dense layers a lane's whole
layer stack is one call
(:mod:`inflight.kernels.decode_stack`: one GIL release per lane and step), else each layer's
attention block is (:mod:`inflight.kernels.decode_block`). Each lane writes only its own
sequences' KV slots. Knows nothing about scheduling; the model call is handed in.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import functools
import itertools
from collections.abc import Callable

import torch

from inflight.runtime.model.batch import AttentionMetadata

# A lane needs enough rows to be worth a thread (measured on the small model: below ~8 rows a
# step is too short for the split to pay for the thread hand-off).
MIN_ROWS_PER_LANE = 4
# ... and the step enough work (parameters x rows) that parallelism pays at all.
MIN_PARAM_TOKENS = 20_000_000
# FLOPs of a lane's products per byte of KV cache its attention reads in the same time: ~50
# GFLOP/s a thread on few-row products against ~8 GB/s a thread streaming cache blocks (a
# 2-core AMD EPYC; bench-medium at 24 rows a lane: 2.25 ms of products per row, 4.6 us of
# attention per context token). Only the split's balance depends on it.
FLOPS_PER_KV_BYTE = 6.0


def row_cost_tokens(num_params: int, kv_bytes_per_token: int) -> float:
    """A decode row's products (two FLOPs a parameter) in context tokens of attention."""
    return 2 * num_params / (FLOPS_PER_KV_BYTE * max(1, kv_bytes_per_token))

LogitsFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeLanes:
    """Runs pure-decode steps split over ``num_lanes`` threads (the caller's is one of them)."""

    def __init__(self, num_lanes: int, min_rows: int = 0, row_cost: float = 0.0) -> None:
        """``min_rows``: the fewest rows a step needs to be split (at least ``MIN_ROWS_PER_LANE``
        a lane); more where a model's few-row products already use every thread (a float copy
        of its packed weights, :mod:`inflight.kernels.cpu_packed`). ``row_cost``: what a row
        costs beside its attention, in context tokens (:func:`row_cost_tokens`); 0 splits the
        rows by context alone, and a very large one by count."""
        if num_lanes < 2:
            raise ValueError(f"decode lanes need at least 2 lanes (got {num_lanes}).")
        self.num_lanes = num_lanes
        self.min_rows = max(min_rows, num_lanes * MIN_ROWS_PER_LANE)
        self.row_cost = row_cost
        self._pool = concurrent.futures.ThreadPoolExecutor(num_lanes - 1, thread_name_prefix="inflight-lane")

    def takes(self, meta: AttentionMetadata, num_params: int) -> bool:
        """A pure-decode step with enough rows and work for every lane."""
        n = meta.num_decode_tokens
        return (meta.num_prefills == 0 and n >= self.min_rows
                and n * num_params >= MIN_PARAM_TOKENS)  # fmt: skip

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        sample_indices: torch.Tensor, logits_fn: LogitsFn,
    ) -> torch.Tensor:
        """Logits ``[num_sampled, vocab]`` of the step, each lane computing its own rows."""
        lanes = self.step_lanes(meta)

        def run(rows: slice) -> torch.Tensor:
            if torch.get_num_threads() != 1:
                torch.set_num_threads(1)
            with torch.inference_mode():
                return logits_fn(input_ids[rows], positions[rows], lane_meta(meta, rows))

        futures = [self._pool.submit(run, rows) for rows in lanes[1:]]
        logits = torch.cat([run(lanes[0]), *(f.result() for f in futures)])
        if sample_indices.shape[0] == logits.shape[0] and torch.equal(sample_indices, _rows(logits.shape[0])):
            return logits  # every row in order (a plain decode step): no gathered copy
        return logits[sample_indices]

    def step_lanes(self, meta: AttentionMetadata) -> list[slice]:
        """The rows of each lane in a pure-decode step (:meth:`lane_rows` of its contexts)."""
        return self.lane_rows(meta.decode_context_lens[: meta.num_decode_tokens].tolist())

    def lane_rows(self, context_lens: list[int]) -> list[slice]:
        """The rows of each lane: ``num_lanes`` contiguous slices, none empty, each ending where
        the estimated work so far (``row_cost`` plus the context, a row) comes closest to its
        share of the step's."""
        n, lanes = len(context_lens), self.num_lanes
        done = list(itertools.accumulate((self.row_cost + c for c in context_lens), initial=0.0))
        bounds = [0]
        for i in range(1, lanes):
            target = done[n] * i / lanes
            end = bisect.bisect_left(done, target)  # done[end - 1] < target <= done[end]
            if end > 0 and target - done[end - 1] < done[end] - target:
                end -= 1
            bounds.append(min(max(end, bounds[-1] + 1), n - (lanes - i)))
        bounds.append(n)
        return [slice(bounds[i], bounds[i + 1]) for i in range(lanes)]

    def close(self) -> None:
        self._pool.shutdown(wait=False)


@functools.lru_cache(maxsize=8)
def _rows(n: int) -> torch.Tensor:
    return torch.arange(n)


def lane_meta(meta: AttentionMetadata, rows: slice) -> AttentionMetadata:
    """The attention metadata of one lane's rows of a pure-decode step (every KV group's rows too)."""
    group_slots, group_tables = meta.group_slot_mapping, meta.group_decode_block_tables
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows], num_decode_tokens=rows.stop - rows.start,
        decode_block_tables=meta.decode_block_tables[rows], decode_context_lens=meta.decode_context_lens[rows],
        prefill_block_tables=meta.prefill_block_tables, prefill_query_start_loc=meta.prefill_query_start_loc,
        prefill_context_lens=meta.prefill_context_lens, num_prefills=0,
        group_slot_mapping=None if group_slots is None else group_slots[:, rows],
        group_decode_block_tables=None if group_tables is None else group_tables[:, rows],
        group_prefill_block_tables=meta.group_prefill_block_tables,
    )  # fmt: skip
