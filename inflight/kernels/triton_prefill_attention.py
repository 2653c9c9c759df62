"""Triton attention for a packed batch of prompt chunks against their paged context.

Owns ``paged_prefill_attention`` (same signature as the reference). Each program takes
``BLOCK_M`` queries of one sequence and one query head; the chunk's own K/V are already in
the cache, so every key comes from the block table: the prefix (earlier chunks, prefix-cache
hits) unmasked, the chunk itself causally. Programs find their sequence by binary search
over ``query_start_loc`` (sequence ``s`` owns tiles from ``query_start_loc[s] // BLOCK_M +
s``), so the grid is sized from the token count alone and launching needs no host sync.
Knows nothing about the scheduler; the reference is the ground truth.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inflight.kernels.fp8_kv import Scale, is_fp8
from inflight.kernels.triton_common import (
    check_dtype,
    check_heads,
    check_kv_cache,
    check_ndim,
    check_paged_inputs,
    check_same_device,
    next_power_of_2,
)
from inflight.kernels.triton_decode_attention import check_sinks
from inflight.kernels.triton_fp8 import FLOAT_KV, kv_args, load_kv_tile_fp8
from inflight.kernels.triton_helpers import (
    dot_precision,
    load_kv_tile,
    needs_upcast,
    online_softmax_step,
)


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Tile sizes: ``block_m`` queries x ``block_n`` keys per inner step."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@functools.lru_cache(maxsize=1024)  # pure; called on every launch
def plan_prefill(
    num_tokens: int, num_seqs: int, head_dim: int, elem_size: int = 2
) -> PrefillConfig:
    """Smaller query tiles for short chunks (mixed batches), 64 for real prompts; narrower
    key tiles for wide rows (fp32, head_dim 256) so the pipelined tiles fit shared memory."""
    avg_len = -(-num_tokens // max(num_seqs, 1))
    block_m = min(64, max(16, next_power_of_2(avg_len)))
    block_n = 64 if head_dim * elem_size <= 256 else 32
    return PrefillConfig(block_m=block_m, block_n=block_n, num_warps=4 if block_m <= 64 else 8)


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile_id, BLOCK_M: tl.constexpr):
    """The last sequence whose first tile (``start // BLOCK_M + s``) is <= ``tile_id``."""
    lo = 0
    hi = num_seqs  # the answer lies in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        go_right = first_tile <= tile_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    query_start_loc_ptr,  # [num_seqs + 1]
    context_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    sinks_ptr,  # [num_heads] sink logits (read when HAS_SINKS)
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    num_seqs,
    head_dim,
    window,  # > 0: a query at position p sees keys after p - window; 0: all before it
    k_scale,  # fp8 caches: what a decoded byte is multiplied by
    v_scale,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    SUB_STEP: tl.constexpr,
):
    tile_id = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = _find_seq(query_start_loc_ptr, num_seqs, tile_id, BLOCK_M)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    local = tile_id - (q_begin // BLOCK_M + seq)
    if local * BLOCK_M >= q_len:  # a spare tile of the over-sized grid
        return
    context_len = tl.load(context_lens_ptr + seq)

    offs_m = local * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_pos = context_len - q_len + offs_m  # [BLOCK_M] absolute positions
    tokens = (q_begin + offs_m).to(tl.int64)
    q_offs = tokens[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_end = tl.minimum(context_len, context_len - q_len + (local + 1) * BLOCK_M)
    # With a window, the tile's first query sees nothing before its position - window + 1.
    first_visible = tl.maximum(context_len - q_len + local * BLOCK_M - window + 1, 0)
    kv_start = tl.where(window > 0, first_visible, 0)
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        pos = tile_start + offs_n  # [BLOCK_N] key positions
        n_mask = pos < kv_end
        if KV_FP8:  # the caches are fp8 bytes: decoded and scaled here
            k, v = load_kv_tile_fp8(k_cache_ptr, v_cache_ptr, table_row, pos, n_mask, kv_head, stride_cb,
                                    stride_cs, stride_ch, offs_d, d_mask, k_scale, v_scale, BLOCK_SIZE, MANT,
                                    BIAS, SUB_STEP)  # fmt: skip
            v = v.to(q.dtype)
        else:
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, pos, n_mask, kv_head,
                                stride_cb, stride_cs, stride_ch, offs_d, d_mask, BLOCK_SIZE)  # fmt: skip
        visible = (pos[None, :] <= q_pos[:, None]) & n_mask[None, :]  # causal within the chunk
        in_window = (pos[None, :] > q_pos[:, None] - window) | (window <= 0)
        visible = visible & in_window
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, qk_scale, m_i, l_i, acc,
                                            DOT_PRECISION, DOT_UPCAST)  # fmt: skip

    if HAS_SINKS:  # the head's sink joins the denominator, rescaled to the new max
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - top)
        l_i = l_i * keep + tl.exp2(sink - top)
        acc = acc * keep[:, None]
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_offs = tokens[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(
        out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :]
    )


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence's queries
    context_lens: torch.Tensor,  # [num_seqs] int32, cached tokens incl. this chunk
    scale: float,
    key: torch.Tensor | None = None,  # accepted for the reference signature; the kernel reads the cache
    value: torch.Tensor | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] logits
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Chunks of prompt tokens attending to their paged context, causal within the chunk
    (and within the last ``sliding_window`` positions when a window is given; with a sink
    logit per head in every softmax when ``sinks`` is given); an fp8 cache's bytes are decoded
    and scaled in the kernel (:mod:`.triton_fp8`), so attention sees the chunk's K/V as stored."""
    check_ndim("query", query, 3, "[num_tokens, num_heads, head_dim]")
    config = plan_prefill(
        query.shape[0], context_lens.shape[0], query.shape[2], query.element_size()
    )
    return prefill_with_config(
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, config,
        sliding_window, sinks, k_scale=k_scale, v_scale=v_scale,
    )


def _check_prefill_inputs(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
) -> int:  # fmt: skip
    """Validate shapes, dtypes and devices; return the GQA group size."""
    if not (is_fp8(k_cache.dtype) or is_fp8(v_cache.dtype)):  # fp8 caches: kv_args checks them
        check_kv_cache(k_cache, v_cache)
    check_ndim("query", query, 3, "[num_tokens, num_heads, head_dim]")
    group = check_heads(query, k_cache)
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    check_paged_inputs(num_seqs, block_tables, context_lens)
    check_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    check_dtype("query_start_loc", query_start_loc, (torch.int32, torch.int64))
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(
            f"query_start_loc needs num_seqs + 1 = {num_seqs + 1} entries "
            f"(got {query_start_loc.shape[0]})."
        )
    check_same_device(query=query, k_cache=k_cache, block_tables=block_tables,
                      query_start_loc=query_start_loc, context_lens=context_lens)  # fmt: skip
    return group


def prefill_with_config(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    context_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    config: PrefillConfig,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] logits
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``paged_prefill_attention`` with explicit tile sizes (tests force small tiles)."""
    group = _check_prefill_inputs(
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens
    )
    fp8 = kv_args(k_cache, v_cache, k_scale, v_scale)
    kv_consts = FLOAT_KV if fp8 is None else fp8.constants
    if query.stride(-1) != 1:
        query = query.contiguous()
    block_tables = block_tables.contiguous()
    query_start_loc, context_lens = query_start_loc.contiguous(), context_lens.contiguous()
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    sinks_arg = check_sinks(sinks, num_heads, query.device)
    grid = (num_tokens // config.block_m + num_seqs, num_heads)
    _prefill_kernel[grid](
        query, k_cache if fp8 is None else fp8.k_cache, v_cache if fp8 is None else fp8.v_cache,
        block_tables, query_start_loc, context_lens, out, sinks_arg,
        scale * math.log2(math.e),
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_seqs, head_dim, sliding_window or 0,
        1.0 if fp8 is None else fp8.k_scale, 1.0 if fp8 is None else fp8.v_scale,
        GROUP=group,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        HAS_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision(query.dtype),
        DOT_UPCAST=needs_upcast(query.device),
        **kv_consts,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )  # fmt: skip
    return out
