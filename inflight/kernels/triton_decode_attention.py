"""Triton paged decode attention (flash-decoding): one query token per sequence.

Owns ``paged_decode_attention`` (same signature as the reference) and the split plan.
Each program takes one sequence, one KV head and one slice ("split") of the context: it
loads that KV head's keys/values once for all ``num_heads // num_kv_heads`` query heads of
the group (GQA), walks the block table ``BLOCK_N`` tokens at a time with an online
softmax, and writes either the final output (one split) or a normalized partial output and
its log-sum-exp, which a second kernel merges. Attention sinks (gpt-oss: a logit per head in
the softmax denominator) join once: at the end of the one split, or in the merge.

The grid's split count comes from the block table's width (an upper bound of every context
length) and the batch, never from the lengths themselves, so launching needs no
device-to-host sync and one CUDA graph serves every context. Inside it each row cuts its own
visible context (read on the device) into ``min(num_splits, ceil(len / MIN_SPLIT_TOKENS))``
slices: with the graphs' table as wide as ``max_model_len``, a row of 2k tokens still runs in
8 splits where a plan sized for the width alone would give it one; the programs past a row's
splits return at once and the merge reads only that row's count.
Knows nothing about the scheduler; the reference is the ground truth.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inflight.kernels.fp8_kv import Scale
from inflight.kernels.triton_common import (
    cdiv,
    check_heads,
    check_kv_cache,
    check_ndim,
    check_paged_inputs,
    check_same_device,
    next_power_of_2,
    num_sms,
)
from inflight.kernels.triton_fp8 import FLOAT_KV, kv_args, load_kv_tile_fp8
from inflight.kernels.triton_helpers import (
    dot_precision,
    load_kv_tile,
    needs_upcast,
    online_softmax_step,
)

MIN_SPLIT_TOKENS = 256  # below this a split's merge costs more than its parallelism pays
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep loads in flight


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How the context is cut: ``num_splits`` slices of ``split_size`` tokens each."""

    num_splits: int
    split_size: int  # tokens, a multiple of block_n
    block_n: int  # tokens per inner-loop tile
    num_warps: int = 4
    num_stages: int = 2
    # > 0: each row cuts its own context into min(num_splits, ceil(len / min_split_tokens))
    # slices on the device (split_size is then only the widest); 0: every row uses split_size
    min_split_tokens: int = 0


@functools.lru_cache(maxsize=1024)  # pure; called on every launch
def plan_decode(
    num_seqs: int, num_kv_heads: int, max_context: int, head_dim: int, sms: int
) -> DecodePlan:
    """Split the context only when sequences x KV heads alone leave SMs idle."""
    block_n = 64 if head_dim <= 128 else 32
    base_programs = max(1, num_seqs * num_kv_heads)
    by_occupancy = cdiv(PROGRAMS_PER_SM * sms, base_programs)
    by_length = cdiv(max(max_context, 1), MIN_SPLIT_TOKENS)
    wanted = max(1, min(by_occupancy, by_length, MAX_SPLITS))
    plan = split_plan(max_context, wanted, block_n)
    return plan if plan.num_splits == 1 else dataclasses.replace(plan, min_split_tokens=MIN_SPLIT_TOKENS)


def row_splits(context_len: int, plan: DecodePlan, window: int = 0) -> tuple[int, int]:
    """(splits, tokens per split) a row of ``context_len`` tokens runs in under ``plan``: what
    the kernels compute on the device (the benchmark and the tests read it here)."""
    if plan.min_split_tokens <= 0:
        return plan.num_splits, plan.split_size
    span = min(context_len, window) if window > 0 else context_len
    splits = min(plan.num_splits, max(1, cdiv(span, plan.min_split_tokens)))
    return splits, cdiv(cdiv(max(span, 1), splits), plan.block_n) * plan.block_n


@triton.jit
def _row_split(context_len, window, num_splits, min_split, BLOCK_N: tl.constexpr):
    """This row's first visible token, split count and split size (see :func:`row_splits`)."""
    lo = tl.where(window > 0, tl.maximum(context_len - window, 0), 0)
    span = context_len - lo
    splits = tl.minimum(tl.maximum(tl.cdiv(span, min_split), 1), num_splits)
    size = tl.cdiv(tl.cdiv(tl.maximum(span, 1), splits), BLOCK_N) * BLOCK_N
    return lo, splits, size


def split_plan(max_context: int, num_splits: int, block_n: int) -> DecodePlan:
    """A plan with about ``num_splits`` equal slices of a context of ``max_context`` tokens."""
    if num_splits < 1 or block_n < 1:
        raise ValueError(f"num_splits and block_n must be >= 1 (got {num_splits}, {block_n}).")
    split_size = cdiv(cdiv(max(max_context, 1), num_splits), block_n) * block_n
    return DecodePlan(
        num_splits=cdiv(max(max_context, 1), split_size), split_size=split_size, block_n=block_n
    )


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    context_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_seqs, num_heads, head_dim] (DIRECT) or unused
    mid_o_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32 (not DIRECT)
    mid_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2 domain (not DIRECT)
    sinks_ptr,  # [num_heads] sink logits (read when HAS_SINKS and DIRECT)
    qk_scale,  # softmax scale * log2(e)
    stride_qs,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_os,
    stride_oh,
    num_heads,
    num_splits,
    split_size,
    head_dim,
    window,  # > 0: only the last `window` context tokens are visible; 0: all of them
    k_scale,  # fp8 caches: what a decoded byte is multiplied by
    v_scale,
    min_split,  # PER_ROW: the fewest tokens a row's split takes
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DIRECT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    SUB_STEP: tl.constexpr,
    PER_ROW: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    if PER_ROW:  # this row's own splits over its visible tokens; programs past them have no work
        lo, splits_here, size_here = _row_split(context_len, window, num_splits, min_split, BLOCK_N)
        if split >= splits_here:
            return
        start = lo + split * size_here
        end = tl.minimum(start + size_here, context_len)
    else:
        start = split * split_size
        end = tl.minimum(start + split_size, context_len)
        # Keys before a window are never loaded (splits wholly before it are empty).
        start = tl.where(window > 0, tl.maximum(start, context_len - window), start)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g  # [BLOCK_G]
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_dim
    q_offs = seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n  # [BLOCK_N] token positions
        n_mask = pos < end
        if KV_FP8:  # the caches are fp8 bytes: decoded and scaled here
            k, v = load_kv_tile_fp8(k_cache_ptr, v_cache_ptr, table_row, pos, n_mask, kv_head, stride_cb,
                                    stride_cs, stride_ch, offs_d, d_mask, k_scale, v_scale, BLOCK_SIZE, MANT,
                                    BIAS, SUB_STEP)  # fmt: skip
            v = v.to(q.dtype)
        else:
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table_row, pos, n_mask, kv_head,
                                stride_cb, stride_cs, stride_ch, offs_d, d_mask, BLOCK_SIZE)  # fmt: skip
        m_i, l_i, acc = online_softmax_step(q, k, v, n_mask[None, :], qk_scale, m_i, l_i, acc,
                                            DOT_PRECISION, DOT_UPCAST)  # fmt: skip

    if DIRECT and HAS_SINKS:  # the sink's exp joins the denominator, rescaled to the new max
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - top)
        l_i = l_i * keep + tl.exp2(sink - top)
        acc = acc * keep[:, None]
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / safe_l[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if DIRECT:
        o_offs = seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (seq * num_heads + heads) * num_splits + split  # [BLOCK_G]
        tl.store(mid_o_ptr + part[:, None] * head_dim + offs_d[None, :], acc, mask=out_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(mid_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    mid_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2 domain
    out_ptr,  # [num_seqs, num_heads, head_dim]
    sinks_ptr,  # [num_heads] sink logits (read when HAS_SINKS)
    context_lens_ptr,  # [num_seqs] (read when PER_ROW)
    stride_os,
    stride_oh,
    num_heads,
    num_splits,
    head_dim,
    window,
    min_split,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PER_ROW: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    if PER_ROW:  # only this row's splits were written
        _, splits_here, _ = _row_split(tl.load(context_lens_ptr + seq), window, num_splits, min_split, BLOCK_N)
        p_mask = offs_p < splits_here
    else:
        p_mask = offs_p < num_splits
    d_mask = offs_d < head_dim
    base = (seq * num_heads + head) * num_splits
    lse = tl.load(mid_lse_ptr + base + offs_p, mask=p_mask, other=float("-inf"))  # [P]
    parts = tl.load(
        mid_o_ptr + (base + offs_p)[:, None] * head_dim + offs_d[None, :],
        mask=p_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [P, D]
    top = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weights = tl.exp2(lse - top)  # empty splits weigh exp2(-inf) = 0
    denom = tl.sum(weights, 0)
    if HAS_SINKS:  # the sink weighs in the denominator only
        denom = denom + tl.exp2(sink - top)
    out = tl.sum(parts * weights[:, None], 0) / denom
    o_offs = seq * stride_os + head * stride_oh + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] logits
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to its cached context (GQA aware), the last
    ``sliding_window`` tokens of it when a window is given, with a sink logit per head when given;
    an fp8 cache's bytes are decoded and scaled in the kernel (:mod:`.triton_fp8`)."""
    if kv_args(k_cache, v_cache, k_scale, v_scale) is None:
        check_kv_cache(k_cache, v_cache)
    check_ndim("query", query, 3, "[num_seqs, num_heads, head_dim]")
    num_seqs = query.shape[0]
    check_paged_inputs(num_seqs, block_tables, context_lens)
    max_context = block_tables.shape[1] * k_cache.shape[1]
    plan = plan_decode(
        num_seqs, k_cache.shape[2], max_context, k_cache.shape[3], num_sms(query.device)
    )
    return decode_with_plan(
        query, k_cache, v_cache, block_tables, context_lens, scale, plan, sliding_window, sinks,
        k_scale=k_scale, v_scale=v_scale,
    )


def _split_workspace(query: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 partial outputs [num_seqs, num_heads, num_splits, head_dim] and their log-sum-exps
    [num_seqs, num_heads, num_splits]; placeholders when there is one split (no merge)."""
    if num_splits == 1:
        placeholder = torch.empty(1, dtype=torch.float32, device=query.device)
        return placeholder, placeholder
    num_seqs, num_heads, head_dim = query.shape
    shape = (num_seqs, num_heads, num_splits)
    return (
        torch.empty((*shape, head_dim), dtype=torch.float32, device=query.device),
        torch.empty(shape, dtype=torch.float32, device=query.device),
    )


def decode_with_plan(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    plan: DecodePlan,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] logits
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """``paged_decode_attention`` with an explicit split plan (tests force splits with it)."""
    group = check_heads(query, k_cache)
    fp8 = kv_args(k_cache, v_cache, k_scale, v_scale)
    kv_consts = FLOAT_KV if fp8 is None else fp8.constants
    check_same_device(
        query=query, k_cache=k_cache, block_tables=block_tables, context_lens=context_lens
    )
    if query.stride(-1) != 1:
        query = query.contiguous()
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    num_seqs, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    direct = plan.num_splits == 1
    per_row = plan.min_split_tokens > 0 and not direct
    mid_o, mid_lse = _split_workspace(query, plan.num_splits)
    sinks_arg = check_sinks(sinks, num_heads, query.device)
    block_d = next_power_of_2(head_dim)
    grid = (num_seqs, k_cache.shape[2], plan.num_splits)
    _decode_split_kernel[grid](
        query, k_cache if fp8 is None else fp8.k_cache, v_cache if fp8 is None else fp8.v_cache,
        block_tables, context_lens, out, mid_o, mid_lse, sinks_arg,
        scale * math.log2(math.e),
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_heads, plan.num_splits, plan.split_size, head_dim, sliding_window or 0,
        1.0 if fp8 is None else fp8.k_scale, 1.0 if fp8 is None else fp8.v_scale,
        max(plan.min_split_tokens, 1),
        GROUP=group,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=plan.block_n,
        BLOCK_SIZE=k_cache.shape[1],
        DIRECT=direct,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION=dot_precision(query.dtype),
        DOT_UPCAST=needs_upcast(query.device),
        **kv_consts,
        PER_ROW=per_row,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )  # fmt: skip
    if not direct:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            mid_o, mid_lse, out, sinks_arg, context_lens,
            out.stride(0), out.stride(1),
            num_heads, plan.num_splits, head_dim, sliding_window or 0, max(plan.min_split_tokens, 1),
            BLOCK_P=next_power_of_2(plan.num_splits),
            BLOCK_D=block_d,
            BLOCK_N=plan.block_n,
            HAS_SINKS=sinks is not None,
            PER_ROW=per_row,
            num_warps=2 if block_d <= 128 else 4,
        )  # fmt: skip
    return out


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> torch.Tensor:
    """``sinks`` as a contiguous float32 ``[num_heads]`` tensor on ``device``, or a placeholder
    the kernels never read when there are none."""
    if sinks is None:
        return torch.empty(1, dtype=torch.float32, device=device)
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must be [num_heads] = [{num_heads}] (got {tuple(sinks.shape)}).")
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, the query on {device}.")
    return sinks.to(torch.float32).contiguous()
