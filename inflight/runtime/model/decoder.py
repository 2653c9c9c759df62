"""The Llama-family decoder over a packed token batch (no padding), reading a paged KV cache.

One flat token tensor holds every scheduled sequence back to back: single-token (decode)
sequences first, then prompt chunks. Attention and KV writes go through a
:class:`~inflight.kernels.ops.KernelOps` bundle. q/k/v and gate/up projections are
fused into one matmul each at load time. A mixture-of-experts model's expert layers take the
dense MLP's place (:mod:`.moe`); Gemma 3's layers (sandwich norms, GELU-tanh MLP, scaled
embeddings) take the other path of :meth:`CausalLM.forward`. A pooling checkpoint (a bare
decoder, or a sequence classifier's ``score`` head) has no LM head: its final-normed hidden
states are what the pooling runner reads (:mod:`inflight.runtime.worker.pooling_runner`). A layer's sliding window and rope
table come from the spec; gpt-oss's attention sinks (``self_attn.sinks``, one logit per query
head, this rank's heads under tensor parallelism) go to the attention kernels as ``sinks``.
In a pure-decode step each layer's attention block (q/k/v split through decode attention) is one
kernel call when the bundle has one (:mod:`inflight.kernels.decode_block`), and when the bundle has a
one-call layer stack (:mod:`inflight.kernels.decode_stack`) and every layer is a dense Llama-family
one with MKL-packed weights, no tensor parallelism, the whole stack and the final norm are one call;
anything else runs op by op. The rows, the kept stack and which steps take them are
:mod:`.decode_paths`'s; which layers the stack can hold is :func:`decode_stack_of`'s. A step with LoRA rows (``meta.token_slots`` set) adds each
row's adapter delta through ``ops.lora_delta`` into the q/k/v slices of the fused qkv output
(before q/k norms and rotary), into the o_proj output, the gate/up slices and the down_proj output
(each before the tensor-parallel all-reduce), from the stacks :mod:`inflight.runtime.lora.slots`
attaches to each layer (``lora``: module name -> its ``a``/``b`` slots). Such a step takes the
layer-by-layer path, never the one-call stack. An fp8 KV cache (:mod:`inflight.kernels.fp8_kv`) passes
each layer's ``k_scale``/``v_scale`` to the store and attention kernels (op by op too:
docs/kv-cache-dtype.md). An EAGLE-3 or MTP head's target states are collected into an
:class:`~inflight.runtime.model.aux_hidden.AuxHidden` along the layer loop. Built with a ``stage`` (:mod:`.stages`) it holds one pipeline stage's layers,
renumbered from 0 (and the embedding, final norm and LM head only where that stage needs them);
:mod:`.stage_forward` runs it. DeepSeek-V3's layers hold latent attention (:mod:`.mla`) in place of
:class:`Attention`, with the same call.
Knows nothing about scheduling or sampling.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inflight.kernels import fp8_kv
from inflight.kernels.decode_block import AttentionLayer, DecodeRows
from inflight.kernels.decode_stack import DecodeStack, StackLayer
from inflight.kernels.ops import KernelOps
from inflight.runtime.model.aux_hidden import AuxHidden
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.collectives import Collectives
from inflight.runtime.model.decode_paths import StackCache, layer_rows, stack_applies, step_rows
from inflight.runtime.model.layout import ShardLayout, shard_layout
from inflight.runtime.model.llama4 import LayerAttention, layer_attention
from inflight.runtime.model.mla import MlaAttention
from inflight.runtime.model.moe import SparseMoe
from inflight.runtime.model.spec import ModelSpec
from inflight.runtime.model.stages import StageLayers


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(
        self, spec: ModelSpec, layout: ShardLayout, tp: Collectives | None, window: int | None = None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        self.window = window  # keys after position - window are visible; None: all earlier ones
        self.rope_table = 0  # which of the rope tables this layer rotates with (set by DecoderLayer)
        self.variant: LayerAttention | None = None  # Llama 4's rotary/norm/chunking options (set by DecoderLayer)
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.q_size = layout.num_heads * spec.head_dim
        self.kv_size = layout.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.scale = spec.attn_scale if spec.attn_scale is not None else spec.head_dim**-0.5
        self.sinks = nn.Parameter(torch.empty(layout.num_heads)) if spec.attn_sinks else None  # [num_heads]
        self.lora: dict[str, Any] | None = None  # module name -> its LoRA slots (.a, .b); set by lora.slots
        # An fp8 KV cache's (k_scale, v_scale), set by inflight.runtime.model.kv_scales; None: a float
        # cache. calculate_kv_scales: the first prompt's K/V set them (then it turns False).
        self.kv_scales: tuple[float, float] | None = None
        self.calculate_kv_scales = False
        self.checkpoint_kv_scales: dict[str, float] = {}  # "k"/"v" -> the checkpoint's scale (the loader's)

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,  # [num_tables, max_position, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        ops: KernelOps,
        rows: DecodeRows | None = None,  # a pure-decode step's rows: the block in one call
    ) -> torch.Tensor:
        spec = self.spec
        num_tokens = x.shape[0]
        qkv = ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        lora, slots = (self.lora, meta.token_slots) if meta.token_slots is not None else (None, None)
        if lora is not None:
            q_end, k_end = self.q_size, self.q_size + self.kv_size
            for module, part in (("q_proj", qkv[:, :q_end]), ("k_proj", qkv[:, q_end:k_end]),
                                 ("v_proj", qkv[:, k_end:])):  # fmt: skip
                ops.lora_delta(x, lora[module].a, lora[module].b, slots, part)
        if rows is not None and ops.decode_attention_block is not None:
            out = ops.decode_attention_block(qkv, rows, cos_sin[self.rope_table], kv_cache, self._layer())
            return self._o_proj(out, ops, lora, slots)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, spec.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, spec.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, spec.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = ops.rms_norm(q, self.q_norm.weight, self.q_norm.eps)[0]
            k = ops.rms_norm(k, self.k_norm.weight, self.k_norm.eps)[0]
        if self.variant is None:
            q, k = ops.rotary_embedding(positions, q, k, cos_sin[self.rope_table])
        else:  # Llama 4: NoPE or RoPE + L2 norm; a chunked layer reads `meta` rewritten (model/llama4.py)
            q, k, meta = self.variant.apply(q, k, positions, cos_sin[self.rope_table], meta, kv_cache[0], ops)
        k_cache, v_cache = kv_cache
        kv = self._kv_scale_args(k, v, k_cache, meta)
        ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, **kv)
        nd, window = meta.num_decode_tokens, self.window
        sinks = {} if self.sinks is None else {"sinks": self.sinks}  # only gpt-oss passes sinks
        sinks.update(kv)
        if meta.num_prefills == 0:
            out = ops.paged_decode_attention(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale, window,
                **sinks,
            )
        elif nd == 0:
            out = ops.paged_prefill_attention(
                q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                meta.prefill_context_lens, self.scale, key=k, value=v, sliding_window=window, **sinks,
            )
        else:
            out = torch.empty_like(q)
            out[:nd] = ops.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale, window,
                **sinks,
            )
            out[nd:] = ops.paged_prefill_attention(
                q[nd:], k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                meta.prefill_context_lens, self.scale, key=k[nd:], value=v[nd:], sliding_window=window, **sinks,
            )
        return self._o_proj(out.reshape(num_tokens, self.q_size), ops, lora, slots)

    def _kv_scale_args(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       meta: AttentionMetadata) -> dict[str, float]:  # fmt: skip
        """The fp8 cache's scales as kernel keywords ({} for a float cache); the first step with a
        prompt chunk sets them when they are to be calculated (its K/V amax / 200 and / 100, vLLM's)."""
        if self.kv_scales is None:
            return {}
        if self.calculate_kv_scales and meta.num_prefills:
            self.kv_scales = (fp8_kv.amax_scale(k, fp8_kv.K_SCALE_RANGE), fp8_kv.amax_scale(v, fp8_kv.V_SCALE_RANGE))
            self.calculate_kv_scales = False
        return {"k_scale": self.kv_scales[0], "v_scale": self.kv_scales[1]}

    def _o_proj(self, attn: torch.Tensor, ops: KernelOps, lora: dict[str, Any] | None,
                slots: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """o_proj of the attention output ``[num_tokens, q_size]``, its LoRA delta added before the all-reduce."""
        out = ops.linear(attn, self.o_proj.weight, self.o_proj.bias)
        if lora is not None:
            ops.lora_delta(attn, lora["o_proj"].a, lora["o_proj"].b, slots, out)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _layer(self) -> AttentionLayer:
        qk_norm = self.q_norm is not None and self.k_norm is not None
        return AttentionLayer(
            self.num_heads, self.num_kv_heads, self.spec.head_dim, self.scale, self.window, self.sinks,
            self.q_norm.weight if qk_norm else None, self.k_norm.weight if qk_norm else None,
            self.q_norm.eps if qk_norm else 1e-6,
        )  # fmt: skip


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, layout: ShardLayout, tp: Collectives | None) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = layout.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * self.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)
        self.gelu = spec.hidden_act == "gelu_pytorch_tanh"  # Gemma 3; else SwiGLU
        self.lora: dict[str, Any] | None = None  # module name -> its LoRA slots (.a, .b); set by lora.slots

    def forward(self, x: torch.Tensor, ops: KernelOps, token_slots: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = ops.linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        lora = self.lora if token_slots is not None else None
        if lora is not None:
            m = self.intermediate_size
            for module, part in (("gate_proj", gate_up[:, :m]), ("up_proj", gate_up[:, m:])):
                ops.lora_delta(x, lora[module].a, lora[module].b, token_slots, part)
        act = gelu_tanh_and_mul(gate_up) if self.gelu else ops.silu_and_mul(gate_up)
        out = ops.linear(act, self.down_proj.weight, self.down_proj.bias)
        if lora is not None:
            ops.lora_delta(act, lora["down_proj"].a, lora["down_proj"].b, token_slots, out)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layout: ShardLayout, tp: Collectives | None, index: int) -> None:
        super().__init__()
        if spec.mla is not None:  # DeepSeek-V3: latent attention (model/mla.py)
            self.self_attn: Attention | MlaAttention = MlaAttention(spec, layout, tp)
        else:
            self.self_attn = Attention(spec, layout, tp, spec.layer_window(index))
            self.self_attn.rope_table = spec.layer_rope_table(index)
            self.self_attn.variant = layer_attention(spec, index)
        sparse = spec.moe is not None and index in spec.moe.sparse_layers
        self.mlp = SparseMoe(spec, layout, tp) if sparse else MLP(spec, layout, tp)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def sandwich_forward(
        self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, ops: KernelOps,
        rows: DecodeRows | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Gemma 3's layer: a norm before and after attention and before and after the MLP,
        each block's normed output added to the residual stream."""
        x = ops.rms_norm(hidden, self.input_layernorm.weight, self.input_layernorm.eps)[0]
        x = self.self_attn(x, positions, cos_sin, kv_cache, meta, ops, rows)
        x = ops.rms_norm(x, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)[0]
        norm = self.pre_feedforward_layernorm
        x, hidden = ops.rms_norm(x, norm.weight, norm.eps, hidden)  # hidden += x; x = norm(hidden)
        x = run_mlp(self.mlp, x, ops, meta.token_slots)
        x = ops.rms_norm(x, self.post_feedforward_layernorm.weight, self.post_feedforward_layernorm.eps)[0]
        return hidden + x


def run_mlp(mlp: nn.Module, x: torch.Tensor, ops: KernelOps, token_slots: torch.Tensor | None) -> torch.Tensor:
    """A layer's MLP; a dense one gets the step's LoRA rows (an expert layer has no adapters)."""
    return mlp(x, ops, token_slots) if isinstance(mlp, MLP) else mlp(x, ops)


def decode_stack_of(model: CausalLM, cos_sin: torch.Tensor,
                    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DecodeStack | None:
    """``model``'s layers as the one-call stack takes them; None unless every layer is dense
    (SwiGLU, no sandwich norms) and unsharded (the weights' own checks: DecodeStack.build)."""
    if model.tp is not None or model.spec.sandwich_norms or len(kv_caches) != len(model.layers):
        return None
    layers = []
    for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, MLP) or mlp.gelu:
            return None
        pre, post = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(StackLayer(
            pre.weight, pre.eps, attn.qkv_proj.weight, attn.qkv_proj.bias, attn._layer(), cos_sin[attn.rope_table],
            kv_cache, attn.o_proj.weight, attn.o_proj.bias, post.weight, post.eps, mlp.gate_up_proj.weight,
            mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias,
        ))  # fmt: skip
    return DecodeStack.build(layers, model.norm.weight, model.norm.eps)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [num_tokens, d]
    """GeGLU (Gemma): ``gelu_tanh(gate) * up`` for ``gate_up`` [num_tokens, 2 * d] (gate, then up)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class CausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and the LM head (this rank's shard of each)."""

    def __init__(self, spec: ModelSpec, tp: Collectives | None = None, stage: StageLayers | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp
        # a pipeline stage (model/stages.py) holds its layers (renumbered from 0), the embedding
        # on the first stage (the last too when tied), the final norm and LM head on the last
        self.stage = stage
        first, last = stage is None or stage.is_first, stage is None or stage.is_last
        layer_ids = range(spec.num_layers) if stage is None else range(stage.start, stage.end)
        self.layout = shard_layout(spec, 0, 1) if tp is None else shard_layout(spec, tp.rank, tp.world_size)
        vocab = self.layout.vocab_per_rank
        # given its table, nn.Embedding skips its random init: on the meta device that init
        # costs seconds per process (the first meta normal_ imports torch's reference ops)
        embeds = first or (last and spec.tie_word_embeddings)
        self.embed_tokens = (nn.Embedding(vocab, spec.hidden_size, _weight=torch.empty(vocab, spec.hidden_size))
                             if embeds else None)  # fmt: skip
        self.layers = nn.ModuleList(DecoderLayer(spec, self.layout, tp, i) for i in layer_ids)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if last else None
        # A pooling checkpoint (spec.head "none" or "score") has no LM head; a classifier has its
        # score head [num_labels, hidden] instead (ModelSpec.head).
        self.lm_head = nn.Linear(spec.hidden_size, vocab, bias=False) if spec.head == "lm" and last else None
        self.score = nn.Linear(spec.hidden_size, spec.num_labels, bias=False) if spec.head == "score" else None
        if spec.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight
        self._stack = StackCache()  # the one-call decode stack (model/decode_paths.py)
        self.kv_layer_groups: tuple[int, ...] | None = None  # per-group KV tables: each layer's group (the runner's)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        ops: KernelOps,
        aux: AuxHidden | None = None,  # EAGLE-3: collect these layers' input states (one stage only)
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]: given rows (images), not input_ids
    ) -> torch.Tensor:  # [num_tokens, hidden], final-normed
        if self.stage is not None:  # a pipeline stage runs through model/stage_forward.py
            raise ValueError("a pipeline stage runs through stage_forward.run_stage (and an EAGLE-3 head needs "
                             "the whole model on one stage)")
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if self.spec.embed_scale is not None:
            hidden = hidden * torch.tensor(self.spec.embed_scale, dtype=hidden.dtype)
        # the one-call paths and the choices that rule them out: model/decode_paths.py
        rows = step_rows(self.spec.arch, positions, kv_caches, meta, ops)
        metas, rows_of_layer = layer_rows(meta, self.kv_layer_groups, len(self.layers), rows, positions, ops)
        if stack_applies(rows, meta, ops, aux is not None):
            stack = self._decode_stack(cos_sin, kv_caches)
            out = None if stack is None else ops.decode_layer_stack(hidden, rows, stack)
            if out is not None:
                return out
        if self.spec.sandwich_norms:
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                if aux is not None:
                    aux.keep(i, hidden)
                hidden = layer.sandwich_forward(hidden, positions, cos_sin, kv_cache, metas[i], ops, rows_of_layer[i])
            return ops.rms_norm(hidden, self.norm.weight, self.norm.eps)[0]
        residual: torch.Tensor | None = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if aux is not None:
                aux.keep(i, hidden, residual)
            norm = layer.input_layernorm
            x, residual = ops.rms_norm(hidden, norm.weight, norm.eps, residual)
            x = layer.self_attn(x, positions, cos_sin, kv_cache, metas[i], ops, rows_of_layer[i])
            norm = layer.post_attention_layernorm
            x, residual = ops.rms_norm(x, norm.weight, norm.eps, residual)
            hidden = run_mlp(layer.mlp, x, ops, meta.token_slots)
        out, last = ops.rms_norm(hidden, self.norm.weight, self.norm.eps, residual)
        if aux is not None:  # MTP: the last layer's output, before the norm
            aux.keep(len(self.layers), last)
        return out

    def _decode_stack(self, cos_sin: torch.Tensor,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DecodeStack | None:  # fmt: skip
        weight = self.layers[0].self_attn.qkv_proj.weight if len(self.layers) else None
        return self._stack.get(kv_caches, cos_sin, weight, lambda: decode_stack_of(self, cos_sin, kv_caches))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        if self.tp is None:
            return self.embed_tokens(input_ids)
        start, end = self.layout.vocab_start, self.layout.vocab_end
        mine = (input_ids >= start) & (input_ids < end)
        hidden = self.embed_tokens(torch.where(mine, input_ids - start, 0))
        hidden.mul_(mine.unsqueeze(-1).to(hidden.dtype))
        return self.tp.all_reduce(hidden)

    def compute_logits(self, hidden: torch.Tensor, ops: KernelOps) -> torch.Tensor | None:
        """``[n, vocab]`` float32 logits; None on tensor-parallel ranks other than 0."""
        if self.lm_head is None:
            raise RuntimeError(f"this {self.spec.arch} checkpoint has no LM head (a pooling model)")
        logits = ops.linear(hidden, self.lm_head.weight).float()
        cap = self.spec.final_logit_softcapping
        if cap is not None:  # elementwise, so before or after the vocab gather alike
            logits = torch.tanh(logits / cap) * cap
        if self.tp is None:
            return logits
        gathered = self.tp.gather_vocab(logits)
        return None if gathered is None else gathered[:, : self.spec.vocab_size]
