"""The pooling runner's forward: a step's prompt chunks in, each chunk's part of its pooled vector out.

A pooling step holds prompt chunks only (no decode rows, no sampling). They are packed as
prefill segments (:func:`~inflight.runtime.worker.batch_inputs.pack_segments`), written to the
paged KV cache as any prompt chunk is (so a long prompt is chunked across steps, and a later
chunk attends to the earlier ones), and the final-normed hidden states (transformers'
``last_hidden_state``) are reduced per chunk in one vectorized op: its last row (LAST), the sum
of its rows (MEAN) or its first row (CLS). The core adds the parts of a prompt's chunks up
(:mod:`inflight.runtime.core.pooling_step`). A sequence classifier's score head is applied to the
last rows here (:func:`score_logits`). Knows nothing about scheduling or requests' state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.worker.batch_inputs import Segment, pack_segments

if TYPE_CHECKING:
    from inflight.runtime.worker.model_runner import ModelRunner


def chunk_parts(runner: ModelRunner, chunks: Sequence[ScheduledChunk], pooling_type: str) -> torch.Tensor:
    """``[len(chunks), hidden]`` float32 on the CPU: each chunk's part (see module docstring)."""
    segments = []
    for chunk in chunks:
        segments.append(Segment(chunk.token_ids, chunk.start, chunk.block_table, False, group_tables=chunk.group_tables))
    packed = pack_segments(segments, runner.block_size, runner.device)
    hidden = runner.hidden_states(packed.input_ids, packed.positions, packed.meta)  # [num_tokens, hidden]
    counts = torch.tensor([c.num_tokens for c in chunks], dtype=torch.long, device=hidden.device)
    firsts = torch.tensor(packed.row_starts, dtype=torch.long, device=hidden.device)  # [num_chunks]
    with torch.inference_mode():
        if pooling_type == "LAST":
            parts = hidden[firsts + counts - 1].float()
        elif pooling_type == "CLS":
            parts = hidden[firsts].float()
        elif pooling_type == "MEAN":
            owner = torch.repeat_interleave(torch.arange(len(chunks), device=hidden.device), counts)
            parts = torch.zeros(len(chunks), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            parts.index_add_(0, owner, hidden.float())
        else:
            raise ValueError(f"unknown pooling type {pooling_type!r}")
        if runner.model.score is not None:  # a classifier: the score head at the last token
            parts = score_logits(runner, hidden[firsts + counts - 1])
    return parts.cpu()


def score_logits(runner: ModelRunner, last_rows: torch.Tensor) -> torch.Tensor:  # [n, num_labels] float32
    """A sequence classifier's logits for the last-token hidden states ``last_rows`` [n, hidden]."""
    head = runner.model.score
    if head is None:
        raise RuntimeError("this model has no score head")
    with torch.inference_mode():
        return runner.ops.linear(last_rows, head.weight).float()
