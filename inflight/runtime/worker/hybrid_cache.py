"""The caches of a hybrid model (Qwen3-Next, Granite 4): paged KV for the attention layers, state-pool tensors for the rest.

Each kind of state layer declares the shapes of its two pool tensors (:func:`state_layers`): a
Gated DeltaNet layer (:func:`~inflight.runtime.model.gated_delta_layer.state_shapes`) its conv state
``[num_slots, conv_dim, conv_kernel - 1]`` and recurrent state ``[num_slots, num_v_heads, k_head_dim,
v_head_dim]``; a Mamba-2 layer (:func:`~inflight.runtime.model.mamba2_layer.state_shapes`) its conv
state ``[num_slots, conv_dim, conv_kernel - 1]`` and SSM state ``[num_slots, num_heads, head_dim,
d_state]``. The conv state is in the model's dtype, the other in float32. Such a layer's entry in the
runner's per-layer cache list is its (conv, recurrent) pool pair, allocated once at start (before the
KV cache is sized, so on CUDA the blocks fill what the states leave); an attention layer's entry is
its (K, V) block tensors as for every other model. Each step's rows carry their sequences' slots
(:func:`with_state_slots`, from the ``req_id -> slot`` map the core's
:class:`~inflight.runtime.core.state_pool.StatePool` fills). Knows nothing about scheduling.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.gated_delta_layer import state_shapes as gated_delta_state_shapes
from inflight.runtime.model.mamba2_layer import state_shapes as mamba2_state_shapes
from inflight.runtime.model.spec import ModelSpec
from inflight.runtime.worker.batch_inputs import BatchInputs, packed_order, upload

logger = logging.getLogger(__name__)

StatePair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class StateLayers:
    """A hybrid model's state layers: which, what they are called, and one layer's two pool shapes."""

    layers: tuple[int, ...]
    kind: str  # "linear-attention" or "Mamba-2"
    shapes: tuple[tuple[int, ...], tuple[int, ...]]  # (conv, recurrent) pool tensors of one layer


def state_layers(spec: ModelSpec, num_slots: int) -> StateLayers | None:
    """The state layers of ``spec`` with ``num_slots`` slots; None for a model with none."""
    if spec.linear_attention is not None:
        return StateLayers(spec.linear_attention.layers, "linear-attention",
                           gated_delta_state_shapes(spec.linear_attention, num_slots))  # fmt: skip
    if spec.mamba is not None:
        return StateLayers(spec.mamba.layers, "Mamba-2", mamba2_state_shapes(spec.mamba, num_slots))
    return None


def allocate_states(spec: ModelSpec, num_slots: int, device: torch.device, dtype: torch.dtype) -> dict[int, StatePair]:
    """Layer index -> its (conv, recurrent) state-pool tensors, zeroed; {} for a model with no state layers."""
    found = state_layers(spec, num_slots)
    if found is None:
        return {}
    conv, rec = found.shapes
    states = {i: (torch.zeros(conv, dtype=dtype, device=device), torch.zeros(rec, dtype=torch.float32, device=device))
              for i in found.layers}  # fmt: skip
    per_layer = math.prod(conv) * (torch.finfo(dtype).bits // 8) + math.prod(rec) * 4
    mib = per_layer * len(found.layers) / 2**20
    logger.info("%s: %d state slots for its %d %s layers (%.1f MiB): at most %d sequences run at once "
                "(max_num_sequences)", spec.arch, num_slots, len(found.layers), found.kind, mib,
                num_slots)  # fmt: skip
    return states


def num_attention_layers(spec: ModelSpec, num_layers: int) -> int:
    """Layers of ``num_layers`` that keep paged KV (a hybrid model's state layers keep none)."""
    return num_layers - len(spec.state_layers)


def with_state_slots(batch: BatchInputs, chunks: Sequence[ScheduledChunk], slot_map: Mapping[str, int],
                     device: torch.device) -> BatchInputs:  # fmt: skip
    """``batch`` with each sequence's state slot in ``meta.state_slots`` (in packed order)."""
    try:
        slots = [slot_map[c.req_id] for c in packed_order(chunks)]
    except KeyError as e:
        raise RuntimeError(f"request {e.args[0]!r} runs without a state slot") from None
    meta = dataclasses.replace(batch.meta, state_slots=upload(slots, torch.int64, device))
    return dataclasses.replace(batch, meta=meta)
