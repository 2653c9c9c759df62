"""The packed batch of one forward pass, and how a step's sequences become one.

Sequences are packed without padding: decode rows first (a one-token sequence, or each token
of a speculating chunk, which attends to its context up to and including itself: the whole
chunk's KV is stored before attention runs, so the rows are causal without a prefill kernel),
then prompt chunks as prefill sequences. :func:`pack_segments` is the packing itself;
:func:`prepare_batch` packs the scheduler's chunks for the served model, with the logits rows
laid out as :mod:`inflight.runtime.worker.logit_rows` says, and a draft model's passes pack their own
segments (:mod:`inflight.runtime.spec_decode.draft_proposer`). Chunks with per-group KV tables
(``ScheduledChunk.group_tables``) get every group's slots and tables in the metadata too. Knows nothing about the model or sampling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.worker.block_table_rows import BlockTableRows, stack_tables
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
    block_table: Sequence[int]
    decode_rows: bool  # one decode row per token; else one prefill sequence (after every decode row)
    num_logit_rows: int = 0  # logits are wanted for this many of its last rows
    group_tables: Sequence[Sequence[int]] | None = None  # per-group KV tables (ScheduledChunk.group_tables)


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


def upload_arrays(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays (int64 or int32) as tensors of the same dtypes and shapes on ``device``: on
    the CPU without a copy; on CUDA as one pinned buffer and one non-blocking copy, cut on the
    device (one transfer a step, whatever the number of rows)."""
    if device.type != "cuda":
        return [torch.from_numpy(a) for a in arrays]
    buffer = torch.from_numpy(flatten_arrays(arrays)).pin_memory().to(device, non_blocking=True)
    return cut_buffer(buffer, arrays)


def flatten_arrays(arrays: Sequence[np.ndarray]) -> np.ndarray:  # [total] int64
    """The arrays one after the other, as int64 (what :func:`cut_buffer` cuts back apart)."""
    return np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in arrays])


def cut_buffer(buffer: torch.Tensor, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """``buffer`` (:func:`flatten_arrays` of ``arrays``, on any device) cut into tensors of the
    arrays' shapes and dtypes (views for the int64 ones)."""
    out: list[torch.Tensor] = []
    offset = 0
    for a in arrays:
        part = buffer[offset : offset + a.size].reshape(a.shape)
        out.append(part if a.dtype == np.int64 else part.to(torch.int32))
        offset += a.size
    return out


@dataclass(slots=True)
class _HostBatch:
    """A packed batch on the host (numpy), before its one upload."""

    arrays: list[np.ndarray]  # ids, positions, slots, decode tables, decode lens, prefill tables, q starts, lens
    num_decode_tokens: int
    num_prefills: int
    row_starts: np.ndarray  # [num_segments] int64
    logit_rows: np.ndarray  # [num_logit_rows] int64


def _pack_host(ids: list[int], starts: list[int], counts: list[int], tables: tuple[np.ndarray, np.ndarray],
               logit_counts: list[int], num_decode_segments: int, block_size: int) -> _HostBatch:
    """Pack segments given as columns (the first ``num_decode_segments`` are decode rows; ``tables``:
    their block tables as :func:`~.block_table_rows.stack_tables` stacks them): one numpy op per
    field over the whole batch, no Python loop over tokens."""
    num_segments = len(starts)
    starts_a = np.array(starts, dtype=np.int64)  # [num_segments]
    counts_a = np.array(counts, dtype=np.int64)
    ends = np.cumsum(counts_a)
    row_starts = ends - counts_a
    num_tokens = int(ends[-1]) if num_segments else 0
    seg_of = np.repeat(np.arange(num_segments), counts_a)  # [num_tokens] the segment of each row
    positions = np.arange(num_tokens, dtype=np.int64) - row_starts[seg_of] + starts_a[seg_of]
    table, lens = tables  # [num_segments, width] padded with block 0; [num_segments]
    slots = table[seg_of, positions // block_size].astype(np.int64) * block_size + positions % block_size
    nds = num_decode_segments
    num_decode = int(ends[nds - 1]) if nds else 0
    decode_width = int(lens[:nds].max()) if nds else 1
    prefill_width = int(lens[nds:].max()) if nds < num_segments else 1
    prefill_counts = counts_a[nds:]
    q_starts = np.zeros(num_segments - nds + 1, dtype=np.int32)
    np.cumsum(prefill_counts, out=q_starts[1:])
    k = np.array(logit_counts, dtype=np.int64)
    first = np.repeat(ends - k, k)  # each wanted row: its segment's first wanted row, plus its rank
    logit_rows = first + np.arange(first.size, dtype=np.int64) - np.repeat(np.cumsum(k) - k, k)
    arrays = [
        np.array(ids, dtype=np.int64), positions, slots,
        np.ascontiguousarray(table[seg_of[:num_decode], :decode_width]),
        (positions[:num_decode] + 1).astype(np.int32),
        np.ascontiguousarray(table[nds:, :prefill_width]), q_starts,
        (starts_a[nds:] + prefill_counts).astype(np.int32),
    ]
    return _HostBatch(arrays, num_decode, num_segments - nds, row_starts, logit_rows)


def _group_arrays(ids: list[int], starts: list[int], counts: list[int],
                  group_tables: Sequence[Sequence[Sequence[int]]], logit_counts: list[int], num_decode_segments: int,
                  block_size: int) -> list[np.ndarray]:  # fmt: skip
    """Every KV group's slot mapping, decode tables and prefill tables, each stacked over the groups
    (``group_tables[i][g]``: segment i's table in group g; every group's tables have one width,
    since each group's table has an entry, placeholder or held, for every block of the sequence)."""
    num_groups = len(group_tables[0])
    packed = [_pack_host(ids, starts, counts, stack_tables([t[g] for t in group_tables]), logit_counts,
                         num_decode_segments, block_size) for g in range(num_groups)]  # fmt: skip
    return [np.stack([p.arrays[k] for p in packed]) for k in (2, 3, 5)]


def _meta(tensors: list[torch.Tensor], host: _HostBatch) -> AttentionMetadata:
    _, _, slots, decode_tables, decode_lens, prefill_tables, q_starts, prefill_lens = tensors
    return AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=host.num_decode_tokens, decode_block_tables=decode_tables,
        decode_context_lens=decode_lens, prefill_block_tables=prefill_tables, prefill_query_start_loc=q_starts,
        prefill_context_lens=prefill_lens, num_prefills=host.num_prefills,
    )


def pack_segments(segments: Sequence[Segment], block_size: int, device: torch.device) -> PackedSegments:
    """One packed batch of ``segments`` (every decode-row segment before any prefill one)."""
    ids: list[int] = []
    num_decode = 0
    for i, seg in enumerate(segments):
        if seg.decode_rows:
            if num_decode < i:
                raise RuntimeError("decode-row segments must come before every prefill segment")
            num_decode += 1
        ids.extend(seg.token_ids)
    starts, counts = [s.start for s in segments], [len(s.token_ids) for s in segments]
    logit_counts = [s.num_logit_rows for s in segments]
    host = _pack_host(ids, starts, counts, stack_tables([s.block_table for s in segments]), logit_counts,
                      num_decode, block_size)  # fmt: skip
    grouped = bool(segments) and segments[0].group_tables is not None
    groups = (_group_arrays(ids, starts, counts, [s.group_tables for s in segments], logit_counts, num_decode,  # type: ignore[misc]
                            block_size) if grouped else [])  # fmt: skip
    tensors = upload_arrays([*host.arrays, *groups], device)
    meta = _meta(tensors[:8], host)
    if grouped:
        meta = dataclasses.replace(meta, group_slot_mapping=tensors[-3], group_decode_block_tables=tensors[-2],
                                   group_prefill_block_tables=tensors[-1])  # fmt: skip
    return PackedSegments(tensors[0], tensors[1], meta, tuple(host.row_starts.tolist()),
                          tuple(host.logit_rows.tolist()))  # fmt: skip


def packed_order(chunks: Sequence[ScheduledChunk], proposed: bool = True) -> list[ScheduledChunk]:
    """The chunks in the order :func:`prepare_batch` packs their rows: one-token and speculating
    chunks first, then prompt chunks, each group in the given order. ``proposed`` False: before a
    drafter fills in the drafts it has room for (such a chunk packs as a speculating or one-token
    one, whatever it gets)."""
    decodes, prompts = _split(chunks, proposed)
    return decodes + prompts


def _split(chunks: Sequence[ScheduledChunk],
           proposed: bool = True) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:  # fmt: skip
    """(one-token and speculating chunks, prompt chunks), each in the given order; checks that
    each speculating chunk has its drafts (unless they are not ``proposed`` yet)."""
    decodes: list[ScheduledChunk] = []
    prompts: list[ScheduledChunk] = []
    for c in chunks:
        drafts = c.draft_token_ids
        if drafts:
            if c.num_tokens != 1 + len(drafts):
                raise RuntimeError(f"request {c.req_id!r}: a chunk of {c.num_tokens} tokens with {len(drafts)} drafts")
            decodes.append(c)
        elif c.num_model_drafts:
            if proposed:
                raise RuntimeError(f"request {c.req_id!r} is scheduled to speculate but has no drafts yet")
            decodes.append(c)
        else:
            (decodes if c.num_tokens == 1 else prompts).append(c)
    return decodes, prompts


def prepare_batch(chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device,
                  lora_slots: Mapping[int, int] | None = None,
                  table_rows: BlockTableRows | None = None) -> BatchInputs:  # fmt: skip
    """Pack the scheduled chunks: one-token rows and speculating chunks first (decode path),
    then prompt chunks; logits for each sampling chunk's last row (every row of a speculating
    chunk) and for the prompt-logprob rows. One upload for the whole batch. ``lora_slots``
    (a LoRA adapter's load id -> its device slot): each row's slot goes in ``meta.token_slots``.
    ``table_rows``: the runner's block tables kept from its last batch (without, copied from
    scratch)."""
    decodes, prompts = _split(chunks)
    ordered = decodes + prompts
    num_decodes = len(decodes)
    ids: list[int] = []
    for chunk in ordered:  # each chunk's known tokens, then its drafts (num_tokens in all)
        ids.extend(chunk.token_ids)
        if chunk.draft_token_ids:
            ids.extend(chunk.draft_token_ids)
    starts = [c.start for c in ordered]
    counts = [c.num_tokens for c in ordered]
    tables = [c.block_table for c in ordered]
    # logits: a sampling chunk's last row, or every row of a speculating one
    logit_counts = [(c.num_tokens if c.draft_token_ids else 1) if c.sample else 0 for c in ordered]
    sampled = [c for c in ordered if c.sample]
    sample_counts = [k for k in logit_counts if k]
    logprob_chunks = any(c.facts.prompt_logprobs is not None for c in ordered)
    stacked = (stack_tables(tables) if table_rows is None
               else table_rows.stack([c.req_id for c in ordered], tables))  # fmt: skip
    host = _pack_host(ids, starts, counts, stacked, logit_counts, num_decodes, block_size)
    spans: list[PromptLogprobSpan] = []
    prompt_rows: list[int] = []
    if logprob_chunks:
        for chunk, row in zip(ordered, host.row_starts.tolist(), strict=True):
            start, facts = chunk.start, chunk.facts
            if facts.prompt_logprobs is not None and start < facts.num_prompt_tokens - 1:
                count = min(start + chunk.num_tokens, facts.num_prompt_tokens - 1) - start
                spans.append((chunk, start, count))
                prompt_rows.extend(range(row, row + count))
    order = logit_row_order(host.logit_rows.tolist(), prompt_rows) if prompt_rows else host.logit_rows
    arrays = [*host.arrays, np.asarray(order, dtype=np.int64)]
    if lora_slots:
        arrays.append(np.repeat(np.array([-1 if (load := c.facts.lora_load_id) is None else lora_slots[load]
                                          for c in ordered], dtype=np.int32), counts))  # fmt: skip
    group_tables = [c.group_tables for c in ordered]
    grouped = bool(ordered) and group_tables[0] is not None
    if grouped:  # per-group KV tables: each group's slots and tables, stacked (core/kv_groups.py)
        arrays.extend(_group_arrays(ids, starts, counts, group_tables, logit_counts, num_decodes, block_size))  # type: ignore[arg-type]
    tensors = upload_arrays(arrays, device)
    meta = _meta(tensors[:8], host)
    if lora_slots:
        meta = dataclasses.replace(meta, token_slots=tensors[9])
    if grouped:
        meta = dataclasses.replace(meta, group_slot_mapping=tensors[-3], group_decode_block_tables=tensors[-2],
                                   group_prefill_block_tables=tensors[-1])  # fmt: skip
    return BatchInputs(
        input_ids=tensors[0],
        positions=tensors[1],
        meta=meta,
        sample_indices=tensors[8],
        sampled_chunks=tuple(sampled),
        sample_counts=tuple(sample_counts),
        prompt_logprob_spans=tuple(spans),
    )
