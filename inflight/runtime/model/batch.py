"""The packed batch every rank runs: its tokens and where each reads and writes the paged KV cache.

A leaf (imports only torch): the decoder reads :class:`AttentionMetadata`, the model runner
and the CPU lanes build it, CUDA-graph capture keeps persistent copies of it, and the
tensor-parallel step channel carries a :class:`StepInputs` to the other ranks, all without
importing one another. The channel's wire format is derived from these dataclasses' fields
(:mod:`inflight.runtime.distributed.wire`), so a field added here travels with the step or
fails loudly when its type cannot. Knows nothing about the model, scheduling or processes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    # Hybrid models (Qwen3-Next): each sequence's state-pool slot, decode rows first as packed; None: no
    # linear-attention state (every other model).
    state_slots: torch.Tensor | None = None  # [num_decode_tokens + num_prefills] int64


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
