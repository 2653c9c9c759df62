"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the attention block of a ``deepseek_v3`` or
``deepseek_v2`` layer.

Projections, named as the checkpoints name them: queries through ``q_a_proj`` -> ``q_a_layernorm`` ->
``q_b_proj`` (or one ``q_proj`` when ``q_lora_rank`` is None), each head ``qk_nope_head_dim`` plain
features then ``qk_rope_head_dim`` roped ones; ``kv_a_proj_with_mqa`` gives each token a latent of
``kv_lora_rank`` (normed by ``kv_a_layernorm``) and one roped key shared by every head; ``kv_b_proj``
expands a latent into each head's plain key (``W_UK``) and value (``W_UV``); ``o_proj``.

The paged cache holds the latent and the roped key only (``kv_cache`` is the pair ``(latent_cache,
pe_cache)``, :mod:`inflight.kernels.mla_reference`), stored through ``ops.store_kv_cache`` (each
tensor stored as its own K and V). Decode rows take the absorbed path: ``q_nope @ W_UK`` puts each
query into the latent space, ``ops.paged_mla_decode`` attends over the cached latents and returns a
latent per head, and ``W_UV`` maps it to the head's value space, so decode reads nothing but the
latent cache. Prompt chunks take one of two paths, chosen per chunk by arithmetic
(:func:`absorbs_prefill`): the expanded one (as vLLM's and SGLang's long prefills do) reads the
chunk's whole context (a prefix hit's or an earlier chunk's tokens included) back from the cache,
expands it through ``kv_b_proj`` into per-head K/V and runs causal attention; the absorbed one runs
the decode's algebra for many queries (``ops.paged_mla_prefill``, one call for every such chunk of
the step). Expanding costs ``context * kv_lora_rank * (qk_nope + v)`` multiply-adds a head however
few the queries; absorbing costs ``2 * kv_lora_rank - qk_nope - v`` more a query-key pair (the
scores and the sum run over the latent width) plus the queries' ``W_UK``/``W_UV`` products. So a
whole prompt (queries = context) expands, and a short chunk behind a long cached context (a chunked
prompt's later chunks, a prefix hit's suffix) absorbs: with DeepSeek-V3's widths below about 170
queries a chunk once the context is long, and it reads only the latent cache (no per-head K/V
materialised). Both paths compute ``softmax(q . k * scale)`` in float32; the absorbed one
reassociates the ``W_UK`` product, so they agree to rounding, not bit for bit.

Tensor parallelism splits heads: each rank holds its heads' rows of ``q_b_proj``/``q_proj`` and
``kv_b_proj`` and their columns of ``o_proj``; the latent projections, their norms and the latent
cache are replicated (every rank computes the same latent), and one all-reduce sums ``o_proj``.
The ``W_UK``/``W_UV`` products are batched matmuls of the float ``kv_b_proj`` weight, outside
``KernelOps.linear``: packed (quantized) DeepSeek weights are not served. Knows nothing about
scheduling or files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from inflight.kernels.mla_reference import gather_context
from inflight.kernels.ops import KernelOps
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.collectives import Collectives
from inflight.runtime.model.layout import ShardLayout
from inflight.runtime.model.spec_types import MlaSpec, ModelSpec

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with the default eps


class LatentNorm(nn.Module):
    """An RMSNorm's weight and epsilon (run through ``ops.rms_norm``)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class LatentExpansion(nn.Module):
    """``kv_b_proj``'s ``[heads * (nope + v), kv_lora_rank]`` weight, kept float (not an ``nn.Linear``,
    so CPU prepacking leaves it alone): decode slices it into ``W_UK``/``W_UV`` for batched matmuls."""

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class MlaAttention(nn.Module):
    """One layer's latent attention, this rank's heads of it."""

    def __init__(self, spec: ModelSpec, layout: ShardLayout, tp: Collectives | None) -> None:
        super().__init__()
        mla = spec.mla
        if mla is None:
            raise ValueError(f"the {spec.arch} spec has no latent attention.")
        self.mla, self.tp = mla, tp
        self.num_heads = layout.num_heads
        self.qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.scale = spec.attn_scale if spec.attn_scale is not None else self.qk_head_dim**-0.5
        hidden, heads = spec.hidden_size, layout.num_heads
        if mla.q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(hidden, heads * self.qk_head_dim, bias=False)
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=spec.qkv_bias)
            self.q_a_layernorm = LatentNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=spec.qkv_bias)
        self.kv_a_layernorm = LatentNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentExpansion(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=spec.o_bias)
        # what the rest of the engine asks of every layer's attention (no LoRA, no fp8 KV scales)
        self.rope_table = 0
        self.lora: dict[str, Any] | None = None
        self.kv_scales: tuple[float, float] | None = None
        self.calculate_kv_scales = False
        self.checkpoint_kv_scales: dict[str, float] = {}

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,  # [num_tables, max_position, rope_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # (latent_cache, pe_cache)
        meta: AttentionMetadata,
        ops: KernelOps,
        rows: object = None,  # the one-call decode block's rows: never used by latent attention
    ) -> torch.Tensor:  # [num_tokens, hidden]
        mla, num_tokens, heads = self.mla, x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = ops.linear(x, self.q_proj.weight)
        else:
            q_a = ops.linear(x, self.q_a_proj.weight, self.q_a_proj.bias)
            q = ops.linear(ops.rms_norm(q_a, self.q_a_layernorm.weight, self.q_a_layernorm.eps)[0], self.q_b_proj.weight)
        q = q.view(num_tokens, heads, self.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        compressed = ops.linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)
        latent, k_pe = compressed.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = ops.rms_norm(latent.contiguous(), self.kv_a_layernorm.weight, self.kv_a_layernorm.eps)[0]
        q_pe, k_pe = ops.rotary_embedding(positions, q_pe.contiguous(), k_pe.reshape(num_tokens, 1, -1).contiguous(),
                                          cos_sin[self.rope_table])  # fmt: skip
        latent_cache, pe_cache = kv_cache
        latent = latent.reshape(num_tokens, 1, mla.kv_lora_rank)
        ops.store_kv_cache(latent, latent, latent_cache, latent_cache, meta.slot_mapping)
        ops.store_kv_cache(k_pe, k_pe, pe_cache, pe_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens if meta.num_prefills else num_tokens
        out = q.new_empty(num_tokens, heads, mla.v_head_dim)
        w_kv = self.kv_b_proj.weight.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], w_kv, kv_cache, meta, ops)
        if nd < num_tokens:
            out[nd:] = self._prefill(q_nope[nd:], q_pe[nd:], w_kv, kv_cache, meta, ops)
        attn = out.reshape(num_tokens, heads * mla.v_head_dim)
        result = ops.linear(attn, self.o_proj.weight, self.o_proj.bias)
        return result if self.tp is None else self.tp.all_reduce(result)

    def _decode(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, ops: KernelOps,
    ) -> torch.Tensor:  # [num_decodes, heads, v_head_dim]
        """The absorbed path: queries into the latent space, attention over the latents, ``W_UV`` out."""
        return self._absorbed(q_nope, q_pe, w_kv, ops.paged_mla_decode, kv_cache, meta.decode_block_tables,
                              meta.decode_context_lens)  # fmt: skip

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor, kernel: Callable[..., torch.Tensor],
        kv_cache: tuple[torch.Tensor, torch.Tensor], *paged: torch.Tensor,
    ) -> torch.Tensor:  # [num_queries, heads, v_head_dim]
        """``W_UK`` in, ``kernel`` (``paged_mla_decode`` or ``paged_mla_prefill``, given its ``paged``
        tables and lengths) over the latent cache, ``W_UV`` out."""
        nope = self.mla.qk_nope_head_dim
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]  # [heads, nope, rank], [heads, v, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [num_queries, heads, rank]
        out_latent = kernel(q_latent.contiguous(), q_pe.contiguous(), kv_cache[0], kv_cache[1], *paged, self.scale)
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, w_kv: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, ops: KernelOps,
    ) -> torch.Tensor:  # [num_prefill_tokens, heads, v_head_dim]
        """Each prompt chunk absorbed or expanded (:func:`absorbs_prefill`); the absorbed chunks in
        one kernel call."""
        starts = meta.prefill_query_start_loc.tolist()
        lens = meta.prefill_context_lens.tolist()
        n = meta.num_prefills
        absorbed = [i for i in range(n) if absorbs_prefill(self.mla, starts[i + 1] - starts[i], lens[i])]
        if len(absorbed) == n:  # the whole step's chunks as they are packed
            return self._absorbed(q_nope, q_pe, w_kv, ops.paged_mla_prefill, kv_cache, meta.prefill_block_tables[:n],
                                  meta.prefill_query_start_loc, meta.prefill_context_lens)  # fmt: skip
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.mla.v_head_dim)
        if absorbed:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in absorbed]).to(q_nope.device)
            picked = torch.tensor(absorbed, device=q_nope.device)
            sizes = torch.tensor([0] + [starts[i + 1] - starts[i] for i in absorbed], dtype=torch.int32)
            out[rows] = self._absorbed(
                q_nope[rows], q_pe[rows], w_kv, ops.paged_mla_prefill, kv_cache, meta.prefill_block_tables[picked],
                sizes.cumsum(0).to(torch.int32).to(q_nope.device), meta.prefill_context_lens[picked],
            )  # fmt: skip
        chosen = set(absorbed)
        self._expanded_prefill(q_nope, q_pe, kv_cache, meta, ops, out,
                               [(starts[i], starts[i + 1], lens[i], i) for i in range(n) if i not in chosen])  # fmt: skip
        return out

    def _expanded_prefill(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata, ops: KernelOps, out: torch.Tensor, chunks: list[tuple[int, int, int, int]],
    ) -> None:
        """The expanded path into ``out``: each chunk's ``(lo, hi, context, index)`` context read back
        from the latent cache, expanded through ``kv_b_proj`` into per-head K/V, causal attention (the
        chunk's last query sees it all)."""
        mla, heads = self.mla, self.num_heads
        for lo, hi, context, i in chunks:
            table = meta.prefill_block_tables[i]
            latent = gather_context(kv_cache[0], table, context)  # [context, rank]
            k_pe = gather_context(kv_cache[1], table, context)  # [context, rope_dim]
            kv = ops.linear(latent, self.kv_b_proj.weight).view(context, heads, -1)
            k_nope, value = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
            key = torch.cat([k_nope, k_pe[:, None, :].expand(context, heads, -1)], dim=-1)
            query = torch.cat([q_nope[lo:hi], q_pe[lo:hi]], dim=-1)
            num_queries = hi - lo
            rows = torch.arange(num_queries, device=query.device)[:, None] + (context - num_queries)
            visible = torch.arange(context, device=query.device)[None, :] <= rows  # [queries, context]
            out[lo:hi] = F.scaled_dot_product_attention(
                query.transpose(0, 1).float(), key.transpose(0, 1).float(), value.transpose(0, 1).float(),
                attn_mask=visible, scale=self.scale,
            ).transpose(0, 1).to(out.dtype)  # fmt: skip


def absorbs_prefill(mla: MlaSpec, num_queries: int, context: int) -> bool:
    """Whether a chunk of ``num_queries`` behind ``context`` cached tokens (its own included) costs
    fewer multiply-adds a head absorbed than expanded: expanding adds ``context * rank * (nope + v)``
    once; absorbing adds ``2 * rank - nope - v`` a query-key pair and ``rank * (nope + v)`` a query."""
    rank, nope, v = mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim
    absorbed_extra = num_queries * (context * (2 * rank - nope - v) + rank * (nope + v))
    return absorbed_extra < context * rank * (nope + v)
