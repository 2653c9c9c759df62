"""The packed batch's attention metadata: where each token reads and writes the paged KV cache.

A leaf (imports only torch): the decoder reads it, the model runner and the CPU lanes build
it, CUDA-graph capture keeps persistent copies of it, and the tensor-parallel step channel
(:mod:`inflight.runtime.distributed.comm`) carries it to the other ranks, all without
importing one another. Knows nothing about the model, scheduling or processes.
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
