"""Granite 4 hybrid (``GraniteMoeHybridForCausalLM``): Mamba-2 layers and attention layers.

``layer_types`` says which layers are Mamba-2 (:mod:`.mamba2_layer`, a per-sequence state) and
which attention over the paged KV cache (our :class:`~.decoder.Attention`: fused q/k/v, scale
``attention_multiplier``, rotary only when ``position_embedding_type`` is ``rope``, else NoPE).
Each layer's MLP is the expert layer (softmax over the top-k router logits) plus the shared MLP
(``shared_mlp``: our ``mlp.shared_experts``), or the shared MLP alone as a dense MLP when the
config has no experts. muP: embeddings times ``embedding_multiplier``, each mixer's and MLP's
output times ``residual_multiplier`` before it joins the residual, logits divided by
``logits_scaling``. :func:`checkpoint_name` maps the checkpoint's names (GraniteMoe's
``input_linear``/``output_linear``/``router.layer``) onto ours for the loader.

:class:`GraniteHybridLM` is a :class:`~.decoder.CausalLM` (embedding, final norm, LM head) with its
own layers and forward: ``kv_caches[i]`` is layer ``i``'s (K, V) cache for an attention layer and
its (conv, SSM) state-pool tensors for a Mamba-2 one; ``meta.state_slots`` says each sequence's
slot. Steps run layer by layer (no one-call decode stack, no CUDA graphs, no CPU decode lanes).
Unsharded only. Reads configs; knows nothing about scheduling.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from inflight.kernels.ops import KernelOps
from inflight.runtime.model.aux_hidden import AuxHidden
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.decoder import MLP, Attention, RMSNorm
from inflight.runtime.model.gated_delta_layer import StateRows
from inflight.runtime.model.hybrid_lm import SingleDeviceLM
from inflight.runtime.model.layout import ShardLayout
from inflight.runtime.model.llama4 import LayerAttention
from inflight.runtime.model.mamba2_layer import Mamba2Mixer
from inflight.runtime.model.moe import SparseMoe
from inflight.runtime.model.spec_types import ModelSpec

_NOPE = LayerAttention(use_rope=False, chunk_size=None, l2_norm_eps=None, temperature=None)
_RENAMES = (  # after the loader reads block_sparse_moe as mlp and mlp.router as mlp.gate
    (re.compile(r"\.mlp\.input_linear\.weight$"), ".mlp.experts.gate_up_proj"),
    (re.compile(r"\.mlp\.output_linear\.weight$"), ".mlp.experts.down_proj"),
    (re.compile(r"\.mlp\.gate\.layer\.weight$"), ".mlp.gate.weight"),
)


def checkpoint_name(name: str, spec: ModelSpec) -> str:
    """Our parameter name for checkpoint tensor ``name`` (``model.`` removed, ``block_sparse_moe``
    read as ``mlp``, ``mlp.router`` as ``mlp.gate``)."""
    for pattern, ours in _RENAMES:
        name = pattern.sub(ours, name)
    shared = ".mlp.shared_experts." if spec.moe is not None else ".mlp."
    return name.replace(".shared_mlp.input_linear.", f"{shared}gate_up_proj.").replace(
        ".shared_mlp.output_linear.", f"{shared}down_proj.")


class GraniteHybridLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layout: ShardLayout, index: int) -> None:
        super().__init__()
        self.is_mamba = spec.mamba is not None and index in spec.mamba.layers
        if self.is_mamba:
            assert spec.mamba is not None
            self.mamba = Mamba2Mixer(spec.hidden_size, spec.mamba, spec.rms_norm_eps)
        else:
            self.self_attn = Attention(spec, layout, None)
            self.self_attn.variant = _NOPE if index in spec.nope_layers else None
        self.mlp = SparseMoe(spec, layout, None) if spec.moe is not None else MLP(spec, layout, None)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class GraniteHybridLM(SingleDeviceLM):
    """See module docstring."""

    FAMILY = "Granite 4 hybrid"
    STATE_LAYERS = "Mamba-2 layers"

    def make_layer(self, index: int) -> nn.Module:
        return GraniteHybridLayer(self.spec, self.layout, index)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        ops: KernelOps,
        aux: AuxHidden | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden], final-normed
        hidden = self.embed(input_ids)
        if self.spec.embed_scale is not None:
            hidden = hidden * torch.tensor(self.spec.embed_scale, dtype=hidden.dtype)
        scale = self.spec.residual_multiplier
        rows = StateRows.of(meta) if self.spec.mamba is not None else None  # Granite 4.0 Micro: attention only
        residual: torch.Tensor | None = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if aux is not None:  # EAGLE-3: the states entering its layers
                aux.keep(i, hidden, residual)
            norm = layer.input_layernorm
            x, residual = ops.rms_norm(hidden, norm.weight, norm.eps, residual)
            if layer.is_mamba:
                assert rows is not None
                x = layer.mamba(x, cache, rows, ops)
            else:
                x = layer.self_attn(x, positions, cos_sin, cache, meta, ops)
            norm = layer.post_attention_layernorm
            x, residual = ops.rms_norm(x * scale, norm.weight, norm.eps, residual)
            hidden = layer.mlp(x, ops) * scale
        out, last = ops.rms_norm(hidden, self.norm.weight, self.norm.eps, residual)
        if aux is not None:  # MTP: the last layer's output, before the norm
            aux.keep(len(self.layers), last)
        return out

    def compute_logits(self, hidden: torch.Tensor, ops: KernelOps) -> torch.Tensor | None:
        """``[n, vocab]`` float32 logits, divided by ``logits_scaling`` as transformers does."""
        logits = super().compute_logits(hidden, ops)
        return None if logits is None else logits / self.spec.logits_scaling
