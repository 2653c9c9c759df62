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
:class:`~inflight.runtime.core.state_pool.StatePool` fills).

Speculative decoding: a verified chunk (a sequence's last token plus ``k`` drafts) must leave its
slot holding the state after its last *accepted* token. With speculation on, the pool tensors get
:class:`DraftScratch` slots after the running ones, allocated once at start: ``k`` for each row
that may speculate in one step (fewer than ``disable_by_batch_size`` run when any does, so
``min(max_num_sequences, disable_by_batch_size - 1)`` rows), not one set per sequence, since only
a small batch speculates. :func:`with_state_slots` plans such a step's decode rows position by
position (``meta.state_steps``: the layers run each position through the one-token kernels and
copy each chunk's state after its positions ``0 .. k - 1`` into its scratch slots), and once
the drafts are verified :func:`keep_accepted_states` copies the state after the accepted
position back into the slot (all kept: the slot already holds it). Knows nothing about scheduling.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.batch import StateSteps
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


@dataclass(frozen=True, slots=True)
class DraftScratch:
    """Scratch slots after the ``first`` running ones: ``num_drafts`` for each of ``num_rows``
    speculating rows of a step (row ``r``'s state after its position ``j`` in :meth:`slot`)."""

    first: int
    num_rows: int
    num_drafts: int

    @property
    def num_slots(self) -> int:
        return self.num_rows * self.num_drafts

    def slot(self, row: int, position: int) -> int:
        return self.first + row * self.num_drafts + position


def draft_scratch(spec: ModelSpec, num_slots: int, draft_states: tuple[int, int]) -> DraftScratch | None:
    """The scratch of a hybrid model speculating ``draft_states`` = (rows a step, drafts a row); None
    without state layers or speculation."""
    rows, drafts = draft_states
    if not spec.state_layers or rows < 1 or drafts < 1:
        return None
    return DraftScratch(num_slots, min(rows, num_slots), drafts)


def allocate_states(spec: ModelSpec, num_slots: int, device: torch.device, dtype: torch.dtype,
                    scratch: DraftScratch | None = None) -> dict[int, StatePair]:  # fmt: skip
    """Layer index -> its (conv, recurrent) state-pool tensors, zeroed (``num_slots`` and the
    scratch's); {} for a model with no state layers."""
    extra = scratch.num_slots if scratch is not None else 0
    found = state_layers(spec, num_slots + extra)
    if found is None:
        return {}
    conv, rec = found.shapes
    states = {i: (torch.zeros(conv, dtype=dtype, device=device), torch.zeros(rec, dtype=torch.float32, device=device))
              for i in found.layers}  # fmt: skip
    per_layer = math.prod(conv) * (torch.finfo(dtype).bits // 8) + math.prod(rec) * 4
    mib = per_layer * len(found.layers) / 2**20
    logger.info("%s: %d state slots for its %d %s layers (%.1f MiB): at most %d sequences run at once "
                "(max_num_sequences)", spec.arch, num_slots, len(found.layers), found.kind,
                mib * num_slots / (num_slots + extra), num_slots)  # fmt: skip
    if scratch is not None:
        logger.info("%s: %d scratch state slots for speculation (%d rows x %d drafts, %.1f MiB): each verified "
                    "chunk keeps the state after its last accepted token", spec.arch, extra, scratch.num_rows,
                    scratch.num_drafts, mib * extra / (num_slots + extra))  # fmt: skip
    return states


def num_attention_layers(spec: ModelSpec, num_layers: int) -> int:
    """Layers of ``num_layers`` that keep paged KV (a hybrid model's state layers keep none)."""
    return num_layers - len(spec.state_layers)


def with_state_slots(batch: BatchInputs, chunks: Sequence[ScheduledChunk], slot_map: Mapping[str, int],
                     device: torch.device, scratch: DraftScratch | None = None) -> BatchInputs:  # fmt: skip
    """``batch`` with the state slots in ``meta.state_slots`` (each decode row's, then each prompt
    chunk's, in packed order) and, when chunks speculate, their position plan in ``meta.state_steps``."""
    ordered = packed_order(chunks)
    try:
        chunk_slots = [slot_map[c.req_id] for c in ordered]
    except KeyError as e:
        raise RuntimeError(f"request {e.args[0]!r} runs without a state slot") from None
    decodes = [c for c in ordered if c.draft_token_ids or c.num_tokens == 1]  # as packed_order splits them
    slots = [s for c, s in zip(decodes, chunk_slots, strict=False) for _ in range(c.num_tokens)]
    slots.extend(chunk_slots[len(decodes) :])
    steps = None
    if any(c.draft_token_ids for c in decodes):
        steps = _position_plan(decodes, chunk_slots[: len(decodes)], scratch, device)
    meta = dataclasses.replace(batch.meta, state_slots=upload(slots, torch.int64, device), state_steps=steps)
    return dataclasses.replace(batch, meta=meta)


def _position_plan(decodes: Sequence[ScheduledChunk], slots: Sequence[int], scratch: DraftScratch | None,
                   device: torch.device) -> StateSteps:  # fmt: skip
    """The decode rows position-major, and after each position the speculating chunks' states to keep."""
    firsts = [0]
    for c in decodes:
        firsts.append(firsts[-1] + c.num_tokens)
    rows: list[int] = []
    row_slots: list[int] = []
    initial: list[int] = []
    keep_from: list[int] = []
    keep_to: list[int] = []
    row_bounds, keep_bounds = [0], [0]
    drafting = _scratch_rows(decodes, scratch)
    for j in range(max(c.num_tokens for c in decodes)):
        for c, first, slot in zip(decodes, firsts, slots, strict=False):
            if c.num_tokens > j:
                rows.append(first + j)
                row_slots.append(slot)
                initial.append(int(c.start + j > 0))
            if j < c.num_tokens - 1:
                assert scratch is not None
                keep_from.append(slot)
                keep_to.append(scratch.slot(drafting[c.req_id], j))
        row_bounds.append(len(rows))
        keep_bounds.append(len(keep_from))
    return StateSteps(upload(rows, torch.int64, device), upload(row_slots, torch.int64, device),
                      upload(initial, torch.bool, device), upload(keep_from, torch.int64, device),
                      upload(keep_to, torch.int64, device), torch.tensor(row_bounds, dtype=torch.int64),
                      torch.tensor(keep_bounds, dtype=torch.int64))  # fmt: skip


def _scratch_rows(chunks: Sequence[ScheduledChunk], scratch: DraftScratch | None) -> dict[str, int]:
    """req_id -> scratch row of each speculating chunk of ``chunks`` (in their order)."""
    drafting = [c.req_id for c in chunks if c.draft_token_ids]
    capacity = scratch.num_rows if scratch is not None else 0
    if len(drafting) > capacity:
        raise RuntimeError(f"{len(drafting)} chunks speculate in one step of a hybrid model, which has scratch "
                           f"states for {capacity} (min(max_num_sequences, disable_by_batch_size - 1))")  # fmt: skip
    if scratch is not None and any(len(c.draft_token_ids) > scratch.num_drafts for c in chunks):
        raise RuntimeError(f"a chunk has more than num_speculative_tokens ({scratch.num_drafts}) drafts")
    return {req_id: r for r, req_id in enumerate(drafting)}


def keep_accepted_states(states: Mapping[int, StatePair], chunks: Sequence[ScheduledChunk],
                         accepted: Mapping[str, int], slot_map: Mapping[str, int],
                         scratch: DraftScratch | None) -> None:  # fmt: skip
    """After verification: each speculating chunk's slot gets the state after its last accepted
    token (``accepted[req_id]`` drafts kept). ``chunks``: the step's, as :func:`with_state_slots` had them."""
    ordered = packed_order(chunks)
    rows = _scratch_rows(ordered, scratch)
    src: list[int] = []
    dst: list[int] = []
    for c in ordered:
        if c.draft_token_ids and accepted[c.req_id] < len(c.draft_token_ids):
            assert scratch is not None
            src.append(scratch.slot(rows[c.req_id], accepted[c.req_id]))
            dst.append(slot_map[c.req_id])
    if not dst:
        return
    some = next(iter(states.values()))[0]
    src_t, dst_t = (torch.tensor(v, dtype=torch.int64).to(some.device) for v in (src, dst))
    for conv, rec in states.values():
        conv[dst_t] = conv[src_t]
        rec[dst_t] = rec[src_t]
