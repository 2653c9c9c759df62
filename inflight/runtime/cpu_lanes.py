"""CPU decode lanes: a pure-decode step split by rows over threads, one OpenMP thread each.

On a few CPU cores a decode step is ~100 small ops (norms, activations, attention, and
matmuls of a few rows); with an OpenMP team per op every op pays a fork and a join, and with
passive waits (which the server needs, see ``device_setup.cpu_thread_counts``) each join
wakes a sleeping thread. Decode rows do not interact inside a step, so the batch can be cut
in two (or more) lanes that each run the whole model on their rows in a thread of their own,
single-threaded: one join per step instead of one per op. torch and the native kernels drop
the GIL while they compute, so the lanes run in parallel; between calls a lane holds the GIL
for its Python and may wait for the other lane's, so fewer Python-level calls pay: on the native
CPU kernels with MKL-packed dense layers a lane's whole layer stack is one call
(:mod:`inflight.kernels.decode_stack`: one GIL release per lane and step), else each layer's
attention block is (:mod:`inflight.kernels.decode_block`). Each lane writes only its own
sequences' KV slots. Knows nothing about scheduling; the model call is handed in.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

from inflight.runtime.model.batch import AttentionMetadata

# A lane needs enough rows to be worth a thread (measured on the small model: below ~8 rows a
# step is too short for the split to pay for the thread hand-off).
MIN_ROWS_PER_LANE = 4
# ... and the step enough work (parameters x rows) that parallelism pays at all.
MIN_PARAM_TOKENS = 20_000_000

LogitsFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeLanes:
    """Runs pure-decode steps split over ``num_lanes`` threads (the caller's is one of them)."""

    def __init__(self, num_lanes: int, min_rows: int = 0) -> None:
        """``min_rows``: the fewest rows a step needs to be split (at least ``MIN_ROWS_PER_LANE``
        a lane); more where a model's few-row products already use every thread (a float copy
        of its packed weights, :mod:`inflight.kernels.cpu_packed`)."""
        if num_lanes < 2:
            raise ValueError(f"decode lanes need at least 2 lanes (got {num_lanes}).")
        self.num_lanes = num_lanes
        self.min_rows = max(min_rows, num_lanes * MIN_ROWS_PER_LANE)
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
        lanes = self.lane_rows(meta.num_decode_tokens)

        def run(rows: slice) -> torch.Tensor:
            if torch.get_num_threads() != 1:
                torch.set_num_threads(1)
            with torch.inference_mode():
                return logits_fn(input_ids[rows], positions[rows], lane_meta(meta, rows))

        futures = [self._pool.submit(run, rows) for rows in lanes[1:]]
        logits = [run(lanes[0]), *(f.result() for f in futures)]
        return torch.cat(logits)[sample_indices]

    def lane_rows(self, num_decode_tokens: int) -> list[slice]:
        """The rows of each lane: ``num_lanes`` contiguous slices, as even as they go."""
        n = num_decode_tokens
        bounds = [n * i // self.num_lanes for i in range(self.num_lanes + 1)]
        return [slice(bounds[i], bounds[i + 1]) for i in range(self.num_lanes)]

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def lane_meta(meta: AttentionMetadata, rows: slice) -> AttentionMetadata:
    """The attention metadata of one lane's rows of a pure-decode step."""
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows], num_decode_tokens=rows.stop - rows.start,
        decode_block_tables=meta.decode_block_tables[rows], decode_context_lens=meta.decode_context_lens[rows],
        prefill_block_tables=meta.prefill_block_tables, prefill_query_start_loc=meta.prefill_query_start_loc,
        prefill_context_lens=meta.prefill_context_lens, num_prefills=0,
    )  # fmt: skip
