"""The caches of a hybrid model (Qwen3-Next): paged KV for the attention layers, state-pool tensors for the rest.

A linear-attention layer's entry in the runner's per-layer cache list is its (conv state,
recurrent state) pool pair, ``[num_slots, conv_dim, conv_kernel - 1]`` in the model's dtype and
``[num_slots, num_v_heads, k_head_dim, v_head_dim]`` in float32 (:func:`~inflight.runtime.model.gated_delta_layer.state_shapes`),
allocated once at start (before the KV cache is sized, so on CUDA the blocks fill what the states
leave); an attention layer's entry is its (K, V) block tensors as for every other model. Each
step's rows carry their sequences' slots (:func:`with_state_slots`, from the ``req_id -> slot`` map
the core's :class:`~inflight.runtime.core.state_pool.StatePool` fills). Knows nothing about scheduling.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import torch

from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.gated_delta_layer import state_bytes_per_slot, state_shapes
from inflight.runtime.model.spec import ModelSpec
from inflight.runtime.worker.batch_inputs import BatchInputs, packed_order, upload

logger = logging.getLogger(__name__)

StatePair = tuple[torch.Tensor, torch.Tensor]


def allocate_states(spec: ModelSpec, num_slots: int, device: torch.device, dtype: torch.dtype) -> dict[int, StatePair]:
    """Layer index -> its (conv, recurrent) state-pool tensors, zeroed; {} for a model with no linear layers."""
    linear = spec.linear_attention
    if linear is None:
        return {}
    conv, rec = state_shapes(linear, num_slots)
    states = {i: (torch.zeros(conv, dtype=dtype, device=device), torch.zeros(rec, dtype=torch.float32, device=device))
              for i in linear.layers}  # fmt: skip
    mib = state_bytes_per_slot(linear, dtype) * num_slots / 2**20
    logger.info("%s: %d state slots for its %d linear-attention layers (%.1f MiB): at most %d sequences run at once "
                "(max_num_sequences)", spec.arch, num_slots, len(linear.layers), mib, num_slots)  # fmt: skip
    return states


def num_attention_layers(spec: ModelSpec, num_layers: int) -> int:
    """Layers of ``num_layers`` that keep paged KV (a hybrid model's linear layers keep none)."""
    return num_layers - (len(spec.linear_attention.layers) if spec.linear_attention is not None else 0)


def with_state_slots(batch: BatchInputs, chunks: Sequence[ScheduledChunk], slot_map: Mapping[str, int],
                     device: torch.device) -> BatchInputs:  # fmt: skip
    """``batch`` with each sequence's state slot in ``meta.state_slots`` (in packed order)."""
    try:
        slots = [slot_map[c.req_id] for c in packed_order(chunks)]
    except KeyError as e:
        raise RuntimeError(f"request {e.args[0]!r} runs without a state slot") from None
    meta = dataclasses.replace(batch.meta, state_slots=upload(slots, torch.int64, device))
    return dataclasses.replace(batch, meta=meta)
