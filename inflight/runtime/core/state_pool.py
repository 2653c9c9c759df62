"""The per-sequence state pool of a hybrid model (Qwen3-Next's linear attention, Granite 4's Mamba-2), beside the block pool.

Each running request of a hybrid model holds one slot: its conv and recurrent (SSM) state in every
state layer (the device tensors are the model runner's,
:mod:`inflight.runtime.worker.hybrid_cache`). The KV manager allocates a request's slot with its
first blocks (admission), and frees it with its blocks: at finish, abort and preemption (a
preempted request recomputes from its prompt, so its state is dropped with its KV). A slot needs
no clearing: a sequence whose first token is in a step starts from zeros whatever its slot holds.
The pool's size (``max_num_sequences`` slots, allocated at start) caps the sequences that run: an
admission with no free slot fails like one with no free block, so the scheduler never admits past it.

``slot_map`` (req_id -> slot) is plain data the runner reads when it packs a step (it never sees
the pool). A freed request's entry stays until its slot goes to another request, so a step
already scheduled for it (async scheduling) still finds the slot it ran in; that slot is only
handed out again at a later schedule, whose step runs after it.

:func:`hybrid_config` is the engine's policy for such models: prefix caching off (a cached block
has no recurrent state to resume from; keeping state snapshots at block boundaries is the later
step) and the features that need it refused. Speculative decoding is served (n-gram, a draft
model, an EAGLE-3 head): a verified chunk leaves its slot holding the state after its last
accepted token (the runner's scratch states, :mod:`inflight.runtime.worker.hybrid_cache`).
Imports no torch.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.model.spec import ModelSpec

logger = logging.getLogger("inflight.engine")


class StatePool:
    """``num_slots`` state slots; ``slot_map`` is filled for the runner to read."""

    def __init__(self, num_slots: int, slot_map: dict[str, int]) -> None:
        if num_slots < 1:
            raise ValueError(f"a hybrid model needs at least one state slot (got {num_slots}).")
        self.num_slots = num_slots
        self.slot_map = slot_map
        self._free: deque[int] = deque(range(num_slots))
        self._held: dict[str, int] = {}  # req_id -> slot, the live holders
        self._last_holder: list[str | None] = [None] * num_slots  # whose entry slot_map keeps for each slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._held)

    def holds(self, req_id: str) -> bool:
        return req_id in self._held

    def allocate(self, req_id: str) -> int | None:
        """A slot for ``req_id`` (its own if it holds one); None when every slot is taken."""
        if req_id in self._held:
            return self._held[req_id]
        if not self._free:
            return None
        slot = self._free.popleft()
        stale = self._last_holder[slot]
        if stale is not None and self.slot_map.get(stale) == slot:
            del self.slot_map[stale]
        self._last_holder[slot] = req_id
        self._held[req_id] = slot
        self.slot_map[req_id] = slot
        return slot

    def free(self, req_id: str) -> None:
        """Give back ``req_id``'s slot, if it holds one (its map entry stays until the slot is reused)."""
        slot = self._held.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)


def hybrid_refusal(spec: ModelSpec, config: EngineConfig) -> str | None:
    """Why ``config`` cannot serve ``spec`` when it has state layers (one line), or None."""
    if not spec.state_layers:
        return None
    layers = "Mamba-2" if spec.mamba is not None else "linear-attention"
    refusals = []
    if config.enable_lora:
        refusals.append(f"LoRA adapters (not applied to its {layers} layers)")
    if config.kv_offloading_size:
        refusals.append("the host KV tier (it keeps prefix-cache blocks, and prefix caching is off)")
    if config.kv_cache_dtype not in ("auto", None):
        refusals.append(f"kv_cache_dtype {config.kv_cache_dtype} (its attention layers read a float KV cache)")
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:
        refusals.append(f"tensor or pipeline parallelism (the {layers} layers are not split)")
    if not refusals:
        return None
    kind = "hybrid Mamba-2" if spec.mamba is not None else "hybrid linear attention"
    return (f"{spec.arch} ({kind}) cannot be served with " + "; ".join(refusals)
            + " (docs/models.md).")  # fmt: skip


def hybrid_config(spec: ModelSpec, config: EngineConfig) -> EngineConfig:
    """``config`` for serving ``spec``: unchanged unless the model has state layers;
    then prefix caching is turned off (logged with the reason) and what cannot apply is refused
    (``ValueError``: :func:`hybrid_refusal`)."""
    if not spec.state_layers:
        return config
    refusal = hybrid_refusal(spec, config)
    if refusal is not None:
        raise ValueError(refusal)
    if config.enable_prefix_caching:
        layers = "Mamba-2" if spec.mamba is not None else "linear-attention"
        logger.info("prefix caching is off for %s: its %s layers keep a recurrent state per sequence, which a "
                    "cached KV block cannot restore (state snapshots at block boundaries are not done)",
                    spec.arch, layers)  # fmt: skip
        config = config.replace(enable_prefix_caching=False)
    return config
