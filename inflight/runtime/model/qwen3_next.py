"""Qwen3-Next (``Qwen3NextForCausalLM``): a hybrid of Gated DeltaNet and gated full-attention layers.

``layer_types`` (or ``full_attention_interval``) says which layers are linear attention
(:mod:`.gated_delta_layer`, a per-sequence state) and which full attention over the paged KV
cache; a full-attention layer's ``q_proj`` yields a query and a gate per head (interleaved per
head in the checkpoint), q/k RMSNorms per head, rotary over ``partial_rotary_factor`` of each head,
and the attention output times ``sigmoid(gate)`` before ``o_proj``. Every RMSNorm except the
linear layers' gated one is zero-centred (scales by ``1 + weight``: the loader folds the 1 in,
as for Gemma). Expert layers (``decoder_sparse_step``, ``mlp_only_layers``) route as Qwen3-MoE
(softmax top-k, ``norm_topk_prob``) and add a shared expert scaled by
``sigmoid(x @ shared_expert_gate.T)``.

:class:`Qwen3NextLM` is a :class:`~.decoder.CausalLM` (embedding, final norm, LM head, logits)
with its own layers and forward: ``kv_caches[i]`` is layer ``i``'s (K, V) cache for an attention
layer and its (conv, recurrent) state-pool tensors for a linear one; ``meta.state_slots`` says
each sequence's slot. Its steps run layer by layer (no one-call decode block or stack, no CUDA
graphs, no CPU decode lanes: a path choice). Unsharded only. Reads configs; knows nothing about
scheduling.
"""

from __future__ import annotations

import torch
from torch import nn

from inflight.kernels.ops import KernelOps
from inflight.runtime.model.aux_hidden import AuxHidden
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.collectives import Collectives
from inflight.runtime.model.decoder import MLP, RMSNorm
from inflight.runtime.model.gated_delta_layer import GatedDeltaNet, StateRows
from inflight.runtime.model.hybrid_lm import SingleDeviceLM
from inflight.runtime.model.layout import ShardLayout
from inflight.runtime.model.moe import SparseMoe, select_experts
from inflight.runtime.model.spec_types import ModelSpec


class GatedAttention(nn.Module):
    """Full attention with an output gate (checkpoint name ``self_attn``): q and gate from ``q_proj``."""

    def __init__(self, spec: ModelSpec, layout: ShardLayout) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = layout.num_heads, layout.num_kv_heads, spec.head_dim
        self.q_size = 2 * self.num_heads * spec.head_dim  # query and gate, interleaved per head
        self.kv_size = self.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * spec.head_dim, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.scale = spec.head_dim**-0.5
        # a float KV cache only (an fp8 one is refused for hybrid models: core/state_pool.py)
        self.kv_scales: tuple[float, float] | None = None
        self.calculate_kv_scales = False
        self.checkpoint_kv_scales: dict[str, float] = {}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                ops: KernelOps) -> torch.Tensor:  # fmt: skip
        n, hd = x.shape[0], self.head_dim
        qkv = ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        qg, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qg = qg.view(n, self.num_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(n, self.num_heads * hd)
        q = ops.rms_norm(q.contiguous(), self.q_norm.weight, self.q_norm.eps)[0]
        k = ops.rms_norm(k.reshape(n, self.num_kv_heads, hd), self.k_norm.weight, self.k_norm.eps)[0]
        v = v.reshape(n, self.num_kv_heads, hd)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin[0])
        k_cache, v_cache = kv_cache
        ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        out = torch.empty_like(q)
        if nd:
            out[:nd] = ops.paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                                  meta.decode_context_lens, self.scale, None)  # fmt: skip
        if meta.num_prefills:
            out[nd:] = ops.paged_prefill_attention(
                q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                meta.prefill_context_lens, self.scale, key=k[nd:], value=v[nd:], sliding_window=None,
            )  # fmt: skip
        out = out.reshape(n, self.num_heads * hd) * torch.sigmoid(gate)
        return ops.linear(out, self.o_proj.weight, self.o_proj.bias)


class GatedSharedMoe(SparseMoe):
    """Qwen3-MoE routing plus a shared expert scaled by ``sigmoid(x @ shared_expert_gate.T)``."""

    def __init__(self, spec: ModelSpec, layout: ShardLayout, tp: Collectives | None) -> None:
        super().__init__(spec, layout, tp)
        self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [num_tokens, hidden]
        weights, ids = select_experts(ops.linear(x, self.gate.weight), self.top_k, self.renormalize)
        out = ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        assert self.shared_experts is not None
        shared = self.shared_experts(x, ops) * torch.sigmoid(ops.linear(x, self.shared_expert_gate.weight))
        return out + shared


class Qwen3NextLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layout: ShardLayout, tp: Collectives | None, index: int) -> None:
        super().__init__()
        linear = spec.linear_attention
        self.is_linear = linear is not None and index in linear.layers
        if self.is_linear:
            assert linear is not None
            self.linear_attn = GatedDeltaNet(spec.hidden_size, linear, spec.rms_norm_eps)
        else:
            self.self_attn = GatedAttention(spec, layout)
        sparse = spec.moe is not None and index in spec.moe.sparse_layers
        self.mlp = GatedSharedMoe(spec, layout, tp) if sparse else MLP(spec, layout, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class Qwen3NextLM(SingleDeviceLM):
    """See module docstring."""

    FAMILY = "Qwen3-Next"
    STATE_LAYERS = "linear-attention layers"

    def make_layer(self, index: int) -> nn.Module:
        return Qwen3NextLayer(self.spec, self.layout, None, index)

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
        rows = StateRows.of(meta)
        residual: torch.Tensor | None = None
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if aux is not None:  # EAGLE-3: the states entering its layers
                aux.keep(i, hidden, residual)
            norm = layer.input_layernorm
            x, residual = ops.rms_norm(hidden, norm.weight, norm.eps, residual)
            if layer.is_linear:
                x = layer.linear_attn(x, cache, rows, ops)
            else:
                x = layer.self_attn(x, positions, cos_sin, cache, meta, ops)
            norm = layer.post_attention_layernorm
            x, residual = ops.rms_norm(x, norm.weight, norm.eps, residual)
            hidden = layer.mlp(x, ops)
        out, last = ops.rms_norm(hidden, self.norm.weight, self.norm.eps, residual)
        if aux is not None:  # MTP: the last layer's output, before the norm
            aux.keep(len(self.layers), last)
        return out
