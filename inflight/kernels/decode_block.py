"""The decode attention block as one kernel call: q/k/v split, qk-norm, rotary, KV store, attention.

In a pure-decode step each layer's attention is, per-op, a split and three reshapes of the
fused q/k/v projection, up to two norms, rotary, the KV store, paged decode attention and a
reshape: ~20 Python-level calls, each a chance for a CPU decode lane
(:mod:`inflight.runtime.worker.cpu.lanes`) to lose the GIL to the other lane and wait to get it back.
:func:`decode_attention_block` is the whole block with one signature, so a backend can run it
as one native call (:mod:`.cpu_native`); this module holds its torch reference (the
specification: exactly the per-op reference kernels, in the decoder's order) and the two value
types it takes. :class:`DecodeRows` is the step's per-token tensors in the dtypes and layouts
the kernels read, converted once per step for every layer. Float KV caches only: an fp8 cache's
steps run layer by layer (the decoder's path choice). Knows nothing about the model or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.kernels import fp8_kv, reference


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A pure-decode step's per-token tensors (one token per sequence), contiguous, in the
    kernels' dtypes. Build with :meth:`of` once per step."""

    positions: torch.Tensor  # [num_seqs] int64
    slot_mapping: torch.Tensor  # [num_seqs] int64, -1: not stored
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32, including this step's token

    @classmethod
    def of(cls, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
           context_lens: torch.Tensor) -> DecodeRows:  # fmt: skip
        return cls(contiguous_as(positions, torch.int64), contiguous_as(slot_mapping, torch.int64),
                   contiguous_as(block_tables, torch.int32), contiguous_as(context_lens, torch.int32))


def contiguous_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` itself when it already is ``dtype`` and contiguous (no call that drops the GIL)."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """One layer's attention shape and constants (this rank's heads under tensor parallelism)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # None: the whole context
    sinks: torch.Tensor | None = None  # [num_heads] logits (gpt-oss)
    q_norm: torch.Tensor | None = None  # [head_dim] per-head RMSNorm weight of q (Qwen3), before rotary
    k_norm: torch.Tensor | None = None  # [head_dim], likewise for k
    norm_eps: float = 1e-6


def decode_attention_block(
    qkv: torch.Tensor,  # [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim], q heads, then k, then v
    rows: DecodeRows,
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim], fp32
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # [num_blocks, block_size, num_kv_heads, head_dim] each
    layer: AttentionLayer,
) -> torch.Tensor:  # [num_seqs, num_heads * head_dim]
    """Each sequence's one token: q and k normed per head (when the layer has qk-norm) and
    rotated, k and v stored in the token's cache slot, then q attending to its context; the
    output is flat per token, ready for the output projection."""
    if fp8_kv.is_fp8(kv_cache[0].dtype):  # no place for the layer's scales: the decoder never calls it so
        raise ValueError("the one-call decode attention block reads float KV caches; an fp8 cache runs layer by layer")
    num_seqs = qkv.shape[0]
    q_size, kv_size = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(num_seqs, layer.num_heads, layer.head_dim)
    k = k.reshape(num_seqs, layer.num_kv_heads, layer.head_dim)
    v = v.reshape(num_seqs, layer.num_kv_heads, layer.head_dim)
    if layer.q_norm is not None and layer.k_norm is not None:
        q = reference.rms_norm(q, layer.q_norm, layer.norm_eps)[0]
        k = reference.rms_norm(k, layer.k_norm, layer.norm_eps)[0]
    q, k = reference.rotary_embedding(rows.positions, q, k, cos_sin_cache)
    k_cache, v_cache = kv_cache
    reference.store_kv_cache(k, v, k_cache, v_cache, rows.slot_mapping)
    out = reference.paged_decode_attention(q, k_cache, v_cache, rows.block_tables, rows.context_lens, layer.scale,
                                           layer.sliding_window, layer.sinks)  # fmt: skip
    return out.reshape(num_seqs, q_size)
