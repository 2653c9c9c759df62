"""The packed batch of one forward pass, and how a step's sequences become one.

Sequences are packed without padding: decode rows first (a one-token sequence, or each token
of a speculating chunk, which attends to its context up to and including itself: the whole
chunk's KV is stored before attention runs, so the rows are causal without a prefill kernel),
then prompt chunks as prefill sequences. :func:`pack_segments` is the packing itself;
:func:`prepare_batch` packs the scheduler's chunks for the served model, with the logits rows
laid out as :mod:`inflight.runtime.worker.logit_rows` says, and a draft model's passes pack their own
segments (:mod:`inflight.runtime.spec_decode.draft_proposer`). Knows nothing about the model or sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.worker.logit_rows import PromptLogprobSpan, logit_row_order


@dataclass(frozen=True, slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # Rows of the packed batch to compute logits for, laid out as inflight.runtime.worker.logit_rows says.
    sample_indices: torch.Tensor  # [num_logit_rows]
    sampled_chunks: tuple[ScheduledChunk, ...]
    sample_counts: tuple[int, ...] = ()  # rows per sampled chunk: 1, or 1 + its drafts
    prompt_logprob_spans: tuple[PromptLogprobSpan, ...] = ()


@dataclass(frozen=True, slots=True)
class Segment:
    """``token_ids`` of one sequence at positions ``start ..``, stored through ``block_table``."""

    token_ids: Sequence[int]
    start: int
    block_table: list[int]
    decode_rows: bool  # one decode row per token; else one prefill sequence (after every decode row)
    num_logit_rows: int = 0  # logits are wanted for this many of its last rows


@dataclass(frozen=True, slots=True)
class PackedSegments:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    row_starts: tuple[int, ...]  # segment i's first row in the packed batch
    logit_rows: tuple[int, ...]  # the wanted rows, segment by segment


def upload(values: list[int] | list[list[int]], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``: on CUDA through pinned memory with a non-blocking
    copy, so preparing a step never waits for the GPU to drain."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def upload_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:  # [num_seqs, width] int32
    """Block tables padded with block 0 to the longest (a valid id, never read past a context)."""
    width = max((len(t) for t in tables), default=1)
    rows = [t + [0] * (width - len(t)) for t in tables]
    return upload(rows, torch.int32, device).reshape(len(tables), width)


def pack_segments(segments: Sequence[Segment], block_size: int, device: torch.device) -> PackedSegments:
    """One packed batch of ``segments`` (every decode-row segment before any prefill one)."""
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    row_starts: list[int] = []
    logit_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    prefill_tables: list[list[int]] = []
    prefill_lens: list[int] = []
    q_starts: list[int] = [0]
    for seg in segments:
        start, n, table = seg.start, len(seg.token_ids), seg.block_table
        if seg.decode_rows and prefill_tables:
            raise RuntimeError("decode-row segments must come before every prefill segment")
        row_starts.append(len(ids))
        ids.extend(seg.token_ids)
        positions = range(start, start + n)
        pos.extend(positions)
        slots.extend(table[p // bs] * bs + p % bs for p in positions)
        if seg.decode_rows:
            decode_tables.extend([table] * n)
            decode_lens.extend(range(start + 1, start + n + 1))
        else:
            prefill_tables.append(table)
            prefill_lens.append(start + n)
            q_starts.append(q_starts[-1] + n)
        logit_rows.extend(range(len(ids) - seg.num_logit_rows, len(ids)))
    meta = AttentionMetadata(
        slot_mapping=upload(slots, torch.int64, device),
        num_decode_tokens=len(decode_lens),
        decode_block_tables=upload_tables(decode_tables, device),
        decode_context_lens=upload(decode_lens, torch.int32, device),
        prefill_block_tables=upload_tables(prefill_tables, device),
        prefill_query_start_loc=upload(q_starts, torch.int32, device),
        prefill_context_lens=upload(prefill_lens, torch.int32, device),
        num_prefills=len(prefill_tables),
    )
    return PackedSegments(upload(ids, torch.int64, device), upload(pos, torch.int64, device), meta,
                          tuple(row_starts), tuple(logit_rows))  # fmt: skip


def prepare_batch(chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device) -> BatchInputs:
    """Pack the scheduled chunks: one-token rows and speculating chunks first (decode path),
    then prompt chunks; logits for each sampling chunk's last row (every row of a speculating
    chunk) and for the prompt-logprob rows."""
    for chunk in chunks:
        if len(chunk.draft_token_ids) < chunk.num_model_drafts:
            raise RuntimeError(f"request {chunk.request.req_id!r} is scheduled to speculate but has no drafts yet")
    decodes = [c for c in chunks if c.num_tokens == 1 or c.draft_token_ids]
    prefills = [c for c in chunks if c.num_tokens > 1 and not c.draft_token_ids]
    ordered = decodes + prefills
    segments = []
    for chunk in ordered:
        req, start, n = chunk.request, chunk.request.num_computed_tokens, chunk.num_tokens
        if chunk.draft_token_ids:
            token_ids: Sequence[int] = (req.token_ids[start], *chunk.draft_token_ids)
        else:
            token_ids = req.token_ids[start : start + n]
        rows = (n if chunk.draft_token_ids else 1) if chunk.sample else 0
        segments.append(Segment(token_ids, start, req.block_ids, bool(chunk.draft_token_ids) or n == 1, rows))
    packed = pack_segments(segments, block_size, device)
    spans: list[PromptLogprobSpan] = []
    prompt_rows: list[int] = []
    for chunk, row in zip(ordered, packed.row_starts, strict=True):
        req, start = chunk.request, chunk.request.num_computed_tokens
        if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
            count = min(start + chunk.num_tokens, req.num_prompt_tokens - 1) - start
            spans.append((chunk, start, count))
            prompt_rows.extend(range(row, row + count))
    sampled = tuple(c for c in ordered if c.sample)
    return BatchInputs(
        input_ids=packed.input_ids,
        positions=packed.positions,
        meta=packed.meta,
        sample_indices=upload(logit_row_order(list(packed.logit_rows), prompt_rows), torch.int64, device),
        sampled_chunks=sampled,
        sample_counts=tuple(c.num_tokens if c.draft_token_ids else 1 for c in sampled),
        prompt_logprob_spans=tuple(spans),
    )
