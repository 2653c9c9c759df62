"""Triton paged MLA decode (absorbed): ``paged_mla_decode`` with :mod:`.mla_reference`'s signature.

One program per (sequence, block of ``BLOCK_H`` heads): the heads' latent-space queries
``[BLOCK_H, kv_lora_rank]`` and roped queries ``[BLOCK_H, rope_dim]`` stay in registers while the
sequence's context streams past in ``BLOCK_N``-token tiles gathered through the block table (token
by token, so any block size works); each tile's scores are ``q_latent @ latent.T + q_pe @ k_pe.T``,
folded by an online softmax (exp2, the scale times log2 e), and the output accumulates
``p @ latent`` in fp32. All heads of a sequence read one latent (multi-query attention in the latent
space), so the heads share each tile's load: the cache is read once per ``BLOCK_H`` heads. When
sequences x head blocks alone leave SMs idle, the context is split (flash-decoding's split-k,
:func:`plan_mla_decode`, from shapes only): each split writes its partial output and log-sum-exp in
fp32 and a second kernel merges them. Never reads a tensor on the host (graph-safe). Knows nothing
about the model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.triton_common import (
    cdiv,
    check_dtype,
    check_ndim,
    check_paged_inputs,
    check_same_device,
    num_sms,
)
from inflight.kernels.triton_helpers import dot, dot_precision, needs_upcast

LOG2E = 1.4426950408889634
BLOCK_N = 32  # context tokens a tile
MAX_BLOCK_H = 16  # heads a program (tl.dot wants at least 16 rows)
MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 256  # below this a split's merge costs more than its parallelism pays
PROGRAMS_PER_SM = 2


def plan_mla_decode(num_seqs: int, num_head_blocks: int, max_context: int, sms: int) -> tuple[int, int]:
    """(splits, tokens a split, a multiple of :data:`BLOCK_N`): the context is split only when
    ``num_seqs * num_head_blocks`` programs leave SMs idle and the context is long enough."""
    wanted = min(cdiv(PROGRAMS_PER_SM * sms, max(1, num_seqs * num_head_blocks)),
                 cdiv(max(max_context, 1), MIN_SPLIT_TOKENS), MAX_SPLITS)  # fmt: skip
    return split_of(max_context, max(1, wanted))


def split_of(max_context: int, num_splits: int) -> tuple[int, int]:
    """About ``num_splits`` equal slices of ``max_context`` tokens, each a multiple of BLOCK_N."""
    split_size = cdiv(cdiv(max(max_context, 1), num_splits), BLOCK_N) * BLOCK_N
    return cdiv(max(max_context, 1), split_size), split_size


@triton.jit
def _mla_decode_kernel(
    q_latent_ptr,  # [num_seqs, num_heads, rank]
    q_pe_ptr,  # [num_seqs, num_heads, rope_dim]
    latent_ptr,  # [num_blocks, block_size, 1, rank]
    pe_ptr,  # [num_blocks, block_size, 1, rope_dim]
    block_tables_ptr,  # [num_seqs, max_blocks]
    context_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_seqs, num_heads, rank] (DIRECT)
    mid_o_ptr,  # [num_seqs, num_heads, num_splits, rank] fp32 (not DIRECT)
    mid_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2 domain (not DIRECT)
    stride_qs,
    stride_qh,
    stride_ps,
    stride_ph,
    stride_lb,
    stride_ls,
    stride_eb,
    stride_es,
    stride_bt,
    stride_os,
    stride_oh,
    num_heads,
    rank,
    rope_dim,
    qk_scale,  # softmax scale * log2(e)
    num_splits,
    split_size,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    DIRECT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = heads < num_heads
    c_mask = offs_c < rank
    r_mask = offs_r < rope_dim
    q = tl.load(q_latent_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_c[None, :],
                mask=h_mask[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_C]
    q_pe = tl.load(q_pe_ptr + seq * stride_ps + heads[:, None] * stride_ph + offs_r[None, :],
                   mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    context_len = tl.load(context_lens_ptr + seq)
    table_row = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    start = split * split_size
    end = tl.minimum(start + split_size, context_len)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n  # [BLOCK_N]
        n_mask = pos < end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        latent = tl.load(latent_ptr + (block * stride_lb + slot * stride_ls)[:, None] + offs_c[None, :],
                         mask=n_mask[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_C]
        k_pe = tl.load(pe_ptr + (block * stride_eb + slot * stride_es)[:, None] + offs_r[None, :],
                       mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        scores = dot(q, tl.trans(latent.to(q.dtype)), DOT_PRECISION, DOT_UPCAST)
        scores += dot(q_pe, tl.trans(k_pe.to(q_pe.dtype)), DOT_PRECISION, DOT_UPCAST)
        scores = tl.where(n_mask[None, :], scores * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(latent.dtype), latent, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / safe_l[:, None]
    out_mask = h_mask[:, None] & c_mask[None, :]
    if DIRECT:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_c[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # an empty split (past this row's context) writes lse -inf: it weighs nothing in the merge
        part = (seq * num_heads + heads) * num_splits + split  # [BLOCK_H]
        tl.store(mid_o_ptr + part[:, None] * rank + offs_c[None, :], acc, mask=out_mask)
        tl.store(mid_lse_ptr + part, tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf")), mask=h_mask)


@triton.jit
def _mla_merge_kernel(
    mid_o_ptr,  # [num_seqs, num_heads, num_splits, rank] fp32
    mid_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2 domain
    out_ptr,  # [num_seqs, num_heads, rank]
    stride_os,
    stride_oh,
    num_heads,
    num_splits,
    rank,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_c = tl.arange(0, BLOCK_C)
    p_mask = offs_p < num_splits
    c_mask = offs_c < rank
    base = (seq * num_heads + head) * num_splits
    lse = tl.load(mid_lse_ptr + base + offs_p, mask=p_mask, other=float("-inf"))  # [P]
    parts = tl.load(mid_o_ptr + (base + offs_p)[:, None] * rank + offs_c[None, :],
                    mask=p_mask[:, None] & c_mask[None, :], other=0.0)  # [P, C]
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no context (a graph's padding row): zeros
    weights = tl.exp2(lse - top)  # empty splits weigh exp2(-inf) = 0
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_c, out.to(out_ptr.dtype.element_ty), mask=c_mask)


def paged_mla_decode(
    q_latent: torch.Tensor,  # [num_seqs, num_heads, kv_lora_rank]
    q_pe: torch.Tensor,  # [num_seqs, num_heads, rope_dim]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_lora_rank]
    pe_cache: torch.Tensor,  # [num_blocks, block_size, 1, rope_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    context_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, kv_lora_rank]
    """One query token per sequence attending, in the latent space, to its cached context."""
    block_h = max(16, min(MAX_BLOCK_H, triton.next_power_of_2(q_latent.shape[1])))
    max_context = block_tables.shape[1] * latent_cache.shape[1] if block_tables.dim() == 2 else 0
    plan = plan_mla_decode(q_latent.shape[0], cdiv(q_latent.shape[1], block_h), max_context, num_sms(q_latent.device))
    return decode_with_splits(q_latent, q_pe, latent_cache, pe_cache, block_tables, context_lens, scale, plan)


def decode_with_splits(
    q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, pe_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, plan: tuple[int, int],
) -> torch.Tensor:  # fmt: skip
    """:func:`paged_mla_decode` under ``plan`` ``(num_splits, split_size)`` (tests force splits)."""
    _check(q_latent, q_pe, latent_cache, pe_cache)
    num_seqs, num_heads, rank = q_latent.shape
    check_paged_inputs(num_seqs, block_tables, context_lens)
    check_same_device(q_latent=q_latent, q_pe=q_pe, latent_cache=latent_cache, pe_cache=pe_cache,
                      block_tables=block_tables, context_lens=context_lens)  # fmt: skip
    out = torch.empty_like(q_latent)
    if num_seqs == 0:
        return out
    q_latent, q_pe = q_latent.contiguous(), q_pe.contiguous()
    rope_dim = q_pe.shape[2]
    block_h = max(16, min(MAX_BLOCK_H, triton.next_power_of_2(num_heads)))
    num_splits, split_size = plan
    direct = num_splits == 1
    mid_o = out if direct else torch.empty(num_seqs, num_heads, num_splits, rank, dtype=torch.float32,
                                           device=out.device)  # fmt: skip
    mid_lse = out if direct else torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=out.device)
    block_c = max(16, triton.next_power_of_2(rank))
    grid = (num_seqs, triton.cdiv(num_heads, block_h), num_splits)
    _mla_decode_kernel[grid](
        q_latent, q_pe, latent_cache, pe_cache, block_tables, context_lens, out, mid_o, mid_lse,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), pe_cache.stride(0), pe_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads, rank, rope_dim, scale * LOG2E, num_splits, split_size,
        BLOCK_SIZE=latent_cache.shape[1], BLOCK_H=block_h, BLOCK_C=block_c,
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_N=BLOCK_N,
        DOT_PRECISION=dot_precision(q_latent.dtype), DOT_UPCAST=needs_upcast(q_latent.device), DIRECT=direct,
        num_warps=4, num_stages=2,  # as bench.gpu.compile_check compiles it: fp32 tiles fit sm_80's shared memory
    )  # fmt: skip
    if not direct:
        _mla_merge_kernel[(num_seqs, num_heads)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), num_heads, num_splits, rank,
            BLOCK_P=triton.next_power_of_2(num_splits), BLOCK_C=block_c,
        )  # fmt: skip
    return out


def _check(q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, pe_cache: torch.Tensor) -> None:
    """``ValueError`` for shapes the kernel would read out of bounds."""
    check_ndim("q_latent", q_latent, 3, "[num_seqs, num_heads, kv_lora_rank]")
    check_ndim("q_pe", q_pe, 3, "[num_seqs, num_heads, rope_dim]")
    check_ndim("latent_cache", latent_cache, 4, "[num_blocks, block_size, 1, kv_lora_rank]")
    check_ndim("pe_cache", pe_cache, 4, "[num_blocks, block_size, 1, rope_dim]")
    for name, t in (("q_latent", q_latent), ("q_pe", q_pe), ("latent_cache", latent_cache), ("pe_cache", pe_cache)):
        check_dtype(name, t, (torch.float32, torch.float16, torch.bfloat16))
    if q_pe.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"q_pe {tuple(q_pe.shape)} and q_latent {tuple(q_latent.shape)} need the same rows and heads.")
    if latent_cache.shape[2] != 1 or pe_cache.shape[2] != 1 or latent_cache.shape[:2] != pe_cache.shape[:2]:
        raise ValueError(f"latent_cache {tuple(latent_cache.shape)} and pe_cache {tuple(pe_cache.shape)} must be "
                         "[num_blocks, block_size, 1, width] with the same blocks.")  # fmt: skip
    if latent_cache.shape[3] != q_latent.shape[2] or pe_cache.shape[3] != q_pe.shape[2]:
        raise ValueError(f"the caches' widths ({latent_cache.shape[3]}, {pe_cache.shape[3]}) must match the "
                         f"queries' ({q_latent.shape[2]}, {q_pe.shape[2]}).")  # fmt: skip
    if latent_cache.stride(-1) != 1 or pe_cache.stride(-1) != 1:
        raise ValueError("latent_cache and pe_cache must be contiguous in their last dimension.")
