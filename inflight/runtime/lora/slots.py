"""The device slots of the LoRA pool: per decoder layer and module, ``a [max_loras, R, in]`` and
``b [max_loras, out, R]`` on the runner's device and dtype, this rank's shard of each.

``R`` is ``max_lora_rank``: an adapter of lower rank fills the first rows of A and columns of
B and leaves zeros (exact), and a module an adapter does not target stays zero in its slot.
Under tensor parallelism the column-parallel modules (q/k/v, gate/up) keep the rank's rows
of B (its heads, its MLP columns) and the row-parallel ones (o, down) the rank's columns of A,
so each rank's delta of o/down is a partial sum the layer's all-reduce completes.
:func:`attach` hands each layer's attention and MLP their stacks. Knows nothing about names,
files or which request uses which slot (:mod:`.registry` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.runtime.lora.peft_format import ATTENTION_MODULES, MLP_MODULES, module_shape
from inflight.runtime.model.layout import ShardLayout
from inflight.runtime.model.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class LoRAStack:
    """One module's slots in one layer."""

    a: torch.Tensor  # [max_loras, max_rank, in_features (this rank's)]
    b: torch.Tensor  # [max_loras, out_features (this rank's), max_rank], scaling folded in


def _local_shape(spec: ModelSpec, layout: ShardLayout, module: str) -> tuple[int, int]:
    """(in, out) features of ``module`` on this rank."""
    d = spec.head_dim
    return {"q_proj": (spec.hidden_size, layout.num_heads * d), "k_proj": (spec.hidden_size, layout.num_kv_heads * d),
            "v_proj": (spec.hidden_size, layout.num_kv_heads * d), "o_proj": (layout.num_heads * d, spec.hidden_size),
            "gate_proj": (spec.hidden_size, layout.intermediate_size),
            "up_proj": (spec.hidden_size, layout.intermediate_size),
            "down_proj": (layout.intermediate_size, spec.hidden_size)}[module]  # fmt: skip


def shard(spec: ModelSpec, layout: ShardLayout, module: str, a: torch.Tensor,
          b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """This rank's part of a whole module's (A [r, in], B [out, r])."""
    if not layout.is_sharded:
        return a, b
    d = spec.head_dim
    if module == "q_proj":
        start = layout.q_head_start * d
        return a, b[start : start + layout.num_heads * d]
    if module in ("k_proj", "v_proj"):
        start = layout.kv_head_start * d
        return a, b[start : start + layout.num_kv_heads * d]
    if module in ("gate_proj", "up_proj"):
        start = layout.rank * layout.intermediate_size
        return a, b[start : start + layout.intermediate_size]
    if module == "o_proj":
        start = layout.q_head_start * d
        return a[:, start : start + layout.num_heads * d], b
    start = layout.rank * layout.intermediate_size  # down_proj
    return a[:, start : start + layout.intermediate_size], b


class LoRASlots:
    """``max_loras`` device slots for every adapted module of every layer."""

    def __init__(self, spec: ModelSpec, layout: ShardLayout, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:  # fmt: skip
        self.spec, self.layout = spec, layout
        self.max_loras, self.max_rank = max_loras, max_rank
        self.stacks: list[dict[str, LoRAStack]] = []
        for index in range(spec.num_layers):
            dense = spec.moe is None or index not in spec.moe.sparse_layers
            layer: dict[str, LoRAStack] = {}
            for module in ATTENTION_MODULES + (MLP_MODULES if dense else ()):
                in_f, out_f = _local_shape(spec, layout, module)
                layer[module] = LoRAStack(torch.zeros(max_loras, max_rank, in_f, device=device, dtype=dtype),
                                          torch.zeros(max_loras, out_f, max_rank, device=device, dtype=dtype))
            self.stacks.append(layer)

    @property
    def num_bytes(self) -> int:
        return sum(s.a.numel() * s.a.element_size() + s.b.numel() * s.b.element_size()
                   for layer in self.stacks for s in layer.values())  # fmt: skip

    def load(self, slot: int, tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write an adapter's whole-model ``tensors`` ((layer, module) -> (A [r, in], B [out, r]),
        :class:`~.peft_format.AdapterWeights`) into ``slot``, this rank's shard; the rest of the slot zeroed."""
        self.clear(slot)
        for (index, module), (a, b) in tensors.items():
            stack = self.stacks[index].get(module)
            if stack is None:  # checked at read time; a sparse layer has no MLP slots
                raise ValueError(f"layer {index} has no LoRA slot for {module}")
            in_f, out_f = module_shape(self.spec, module)
            if a.dim() != 2 or a.shape[1] != in_f or tuple(b.shape) != (out_f, a.shape[0]) or a.shape[0] > self.max_rank:
                raise ValueError(f"layer {index} {module}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit the slots")
            a_local, b_local = shard(self.spec, self.layout, module, a, b)
            rank = a.shape[0]
            stack.a[slot, :rank].copy_(a_local)
            stack.b[slot, :, :rank].copy_(b_local)

    def clear(self, slot: int) -> None:
        for layer in self.stacks:
            for stack in layer.values():
                stack.a[slot].zero_()
                stack.b[slot].zero_()


def attach(model: torch.nn.Module, slots: LoRASlots | None) -> None:
    """Give each decoder layer's attention and dense MLP its stacks (None: detach)."""
    for index, layer in enumerate(model.layers):  # type: ignore[attr-defined]
        stacks = slots.stacks[index] if slots is not None else None
        if hasattr(layer, "self_attn"):  # (a hybrid model's linear layers have none; LoRA is refused for them)
            layer.self_attn.lora = stacks
        if hasattr(layer.mlp, "lora"):
            layer.mlp.lora = stacks if stacks is not None and "down_proj" in stacks else None
