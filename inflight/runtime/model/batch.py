"""The packed batch every rank runs: its tokens and where each reads and writes the paged KV cache.

A leaf (imports only torch): the decoder reads :class:`AttentionMetadata`, the model runner
and the CPU lanes build it, CUDA-graph capture keeps persistent copies of it, and the
tensor-parallel step channel carries a :class:`StepInputs` to the other ranks, all without
importing one another. The channel's wire format is derived from these dataclasses' fields
(:mod:`inflight.runtime.distributed.wire`), so a field added here travels with the step or
fails loudly when its type cannot. A model with per-group KV tables (:mod:`inflight.runtime.worker.kv_layout`)
gets every group's slots and tables stacked in the metadata, and each layer reads its group's
(:func:`group_views`). Knows nothing about the model, scheduling or processes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

R = TypeVar("R")  # a layer's one-call decode rows (kernels/decode_block.py's DecodeRows)


@dataclass(frozen=True, slots=True)
class StateSteps:
    """A hybrid model's decode rows position by position, for a step with speculating chunks (each
    a sequence's last token and its drafts): position 0 holds every decode chunk's first row,
    position ``j`` each speculating chunk's ``j``-th; after position ``j`` the state slots
    ``keep_from`` are copied to the scratch slots ``keep_to`` (:mod:`.gated_delta_layer`)."""

    rows: torch.Tensor  # [num_decode_tokens] int64, packed rows, position-major
    slots: torch.Tensor  # [num_decode_tokens] int64, each row's state slot (rows' order)
    has_initial: torch.Tensor  # [num_decode_tokens] bool, continue from the slot
    keep_from: torch.Tensor  # [num_kept] int64, position-major
    keep_to: torch.Tensor  # [num_kept] int64
    # on the host (CPU) whatever the device, so the layers slice without a sync: position j's rows
    # are rows[row_bounds[j]:row_bounds[j + 1]], its kept states keep_*[keep_bounds[j]:keep_bounds[j + 1]]
    row_bounds: torch.Tensor  # [num_positions + 1] int64
    keep_bounds: torch.Tensor  # [num_positions + 1] int64


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where each token of the packed batch reads and writes the paged KV cache."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int  # the first num_decode_tokens tokens are one-token sequences
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, relative to the prefill part
    prefill_context_lens: torch.Tensor  # [num_prefills] int32
    num_prefills: int
    # Multi-LoRA: each token's adapter slot (-1: the base model); None: no row of the step has one.
    token_slots: torch.Tensor | None = None  # [num_tokens] int32
    # Hybrid models (Qwen3-Next, Granite 4): each decode row's state-pool slot (a speculating chunk's rows all
    # carry its sequence's), then each prompt chunk's; None: no recurrent state (every other model).
    state_slots: torch.Tensor | None = None  # [num_decode_tokens + num_prefills] int64
    state_steps: StateSteps | None = None  # speculating chunks in a hybrid model's step; else None
    # Per-group KV tables (worker/kv_layout.py): each group's slots and tables, stacked (group 0's are
    # the fields above); None: one table serves every layer. A layer reads its group's (group_views).
    group_slot_mapping: torch.Tensor | None = None  # [num_groups, num_tokens] int64
    group_decode_block_tables: torch.Tensor | None = None  # [num_groups, num_decodes, max_blocks] int32
    group_prefill_block_tables: torch.Tensor | None = None  # [num_groups, num_prefills, max_blocks] int32


def group_views(meta: AttentionMetadata) -> tuple[AttentionMetadata, ...] | None:
    """Each KV group's metadata (its slots and block tables, the rest shared); None without groups."""
    slots, decode, prefill = meta.group_slot_mapping, meta.group_decode_block_tables, meta.group_prefill_block_tables
    if slots is None or decode is None or prefill is None:
        return None
    return tuple(dataclasses.replace(meta, slot_mapping=slots[g], decode_block_tables=decode[g],
                                     prefill_block_tables=prefill[g], group_slot_mapping=None,
                                     group_decode_block_tables=None, group_prefill_block_tables=None)
                 for g in range(slots.shape[0]))  # fmt: skip


def layer_metas(meta: AttentionMetadata, layer_groups: tuple[int, ...] | None, num_layers: int, rows: R | None,
                rows_of: Callable[[AttentionMetadata], R | None]) -> tuple[list[AttentionMetadata], list[R | None]]:
    """Each layer's metadata and one-call decode rows: ``meta`` and ``rows`` for every layer, or with
    per-group KV tables (``layer_groups``: each layer's group, set on the model by the runner) its
    group's view and that view's rows (``rows_of(view)``, made only when ``rows`` is not None)."""
    views = group_views(meta)
    if views is None or layer_groups is None:
        return [meta] * num_layers, [rows] * num_layers
    group_rows = [None if rows is None else rows_of(v) for v in views]
    return [views[g] for g in layer_groups], [group_rows[g] for g in layer_groups]


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What every tensor-parallel rank needs to run one step's forward: rank 0 broadcasts it.

    The model runner's ``BatchInputs`` is these fields plus :data:`RANK0_ONLY_BATCH_FIELDS`
    (which requests the rows belong to, for sampling: only rank 0 samples);
    ``tests/runtime/test_step_wire.py`` fails when a ``BatchInputs`` field is in neither.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_logit_rows] int64, laid out as inflight.runtime.worker.logit_rows says


# ``BatchInputs`` fields that stay in rank 0 (the engine process) and never cross the wire.
RANK0_ONLY_BATCH_FIELDS = ("sampled_chunks", "sample_counts", "prompt_logprob_spans")
