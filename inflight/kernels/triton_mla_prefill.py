"""Triton paged MLA prefill (absorbed): ``paged_mla_prefill`` with :mod:`.mla_reference`'s signature.

Chunks of query tokens of several sequences, packed back to back (``query_start_loc``), attend in
the latent space to their paged context, causally: a query at position ``p`` sees every cached
latent at or before ``p`` (its own chunk's latents are stored before attention runs). All heads
read the one latent of each token, so a program's rows are ``BLOCK_M`` queries x ``BLOCK_H`` heads
of one sequence flattened into ``ROWS = BLOCK_M * BLOCK_H`` rows (FlashMLA's trick: heads become
rows of the dot): each latent tile ``[BLOCK_N, kv_lora_rank]`` gathered through the block table is
read once for all of them, the scores are ``q_latent @ latent.T + q_pe @ k_pe.T`` per row, masked
causally by the row's query position, folded by an online softmax (exp2, the scale times log2 e),
and the output accumulates ``p @ latent`` in fp32. Programs find their sequence by binary search
over ``query_start_loc`` (:func:`.triton_prefill_attention._find_seq`), so the grid comes from the
token count alone and launching reads nothing on the host. Knows nothing about the model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.triton_common import check_dtype, check_ndim, check_paged_inputs, check_same_device
from inflight.kernels.triton_helpers import dot, dot_precision, needs_upcast
from inflight.kernels.triton_mla_decode import LOG2E
from inflight.kernels.triton_mla_decode import _check as check_mla_widths  # the same query / cache widths
from inflight.kernels.triton_prefill_attention import _find_seq

ROWS = 32  # queries x heads a program (tl.dot wants at least 16 rows; 32 x a 512 latent in fp32 fits 8 warps)
BLOCK_N = 32  # context tokens a tile


def plan_mla_prefill(num_heads: int, rows: int = ROWS) -> tuple[int, int]:
    """(BLOCK_M queries, BLOCK_H heads) a program: as many of a sequence's heads as fit ``rows``
    (powers of two), the rest of the rows its next queries."""
    block_h = min(triton.next_power_of_2(max(num_heads, 1)), rows)
    return rows // block_h, block_h


@triton.jit
def _mla_prefill_kernel(
    q_latent_ptr,  # [num_tokens, num_heads, rank]
    q_pe_ptr,  # [num_tokens, num_heads, rope_dim]
    latent_ptr,  # [num_blocks, block_size, 1, rank]
    pe_ptr,  # [num_blocks, block_size, 1, rope_dim]
    block_tables_ptr,  # [num_seqs, max_blocks]
    query_start_loc_ptr,  # [num_seqs + 1]
    context_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_tokens, num_heads, rank]
    stride_qt,
    stride_qh,
    stride_pt,
    stride_ph,
    stride_lb,
    stride_ls,
    stride_eb,
    stride_es,
    stride_bt,
    stride_ot,
    stride_oh,
    num_seqs,
    num_heads,
    rank,
    rope_dim,
    qk_scale,  # softmax scale * log2(e)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    tile_id = tl.program_id(0)
    seq = _find_seq(query_start_loc_ptr, num_seqs, tile_id, BLOCK_M)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    local = tile_id - (q_begin // BLOCK_M + seq)
    if local * BLOCK_M >= q_len:  # a spare tile of the over-sized grid
        return
    context_len = tl.load(context_lens_ptr + seq)
    offs_row = tl.arange(0, BLOCK_M * BLOCK_H)  # row = query * BLOCK_H + head
    query = local * BLOCK_M + offs_row // BLOCK_H  # [ROWS] query index within the chunk
    heads = tl.program_id(1) * BLOCK_H + offs_row % BLOCK_H  # [ROWS]
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    row_mask = (query < q_len) & (heads < num_heads)
    c_mask = offs_c < rank
    r_mask = offs_r < rope_dim
    tokens = (q_begin + query).to(tl.int64)
    q = tl.load(q_latent_ptr + (tokens * stride_qt + heads * stride_qh)[:, None] + offs_c[None, :],
                mask=row_mask[:, None] & c_mask[None, :], other=0.0)  # [ROWS, BLOCK_C]
    q_pe = tl.load(q_pe_ptr + (tokens * stride_pt + heads * stride_ph)[:, None] + offs_r[None, :],
                   mask=row_mask[:, None] & r_mask[None, :], other=0.0)  # [ROWS, BLOCK_R]
    q_pos = context_len - q_len + query  # [ROWS] absolute positions
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_C], tl.float32)
    kv_end = tl.minimum(context_len, context_len - q_len + (local + 1) * BLOCK_M)  # the tile's last query sees this
    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + offs_n  # [BLOCK_N]
        n_mask = pos < kv_end
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        latent = tl.load(latent_ptr + (block * stride_lb + slot * stride_ls)[:, None] + offs_c[None, :],
                         mask=n_mask[:, None] & c_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_C]
        k_pe = tl.load(pe_ptr + (block * stride_eb + slot * stride_es)[:, None] + offs_r[None, :],
                       mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        scores = dot(q, tl.trans(latent.to(q.dtype)), DOT_PRECISION, DOT_UPCAST)
        scores += dot(q_pe, tl.trans(k_pe.to(q_pe.dtype)), DOT_PRECISION, DOT_UPCAST)
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])  # causal within the chunk
        scores = tl.where(visible, scores * qk_scale, float("-inf"))  # [ROWS, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(latent.dtype), latent, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (tokens * stride_ot + heads * stride_oh)[:, None] + offs_c[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & c_mask[None, :])


def paged_mla_prefill(
    q_latent: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank], sequences packed back to back
    q_pe: torch.Tensor,  # [num_tokens, num_heads, rope_dim]
    latent_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_lora_rank]
    pe_cache: torch.Tensor,  # [num_blocks, block_size, 1, rope_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence's queries
    context_lens: torch.Tensor,  # [num_seqs] int32, cached tokens incl. this chunk
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]
    """Chunks of query tokens attending, in the latent space, to their paged context, causally."""
    return prefill_with_rows(q_latent, q_pe, latent_cache, pe_cache, block_tables, query_start_loc,
                             context_lens, scale, ROWS)  # fmt: skip


def prefill_with_rows(
    q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, pe_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
    rows: int,
) -> torch.Tensor:  # fmt: skip
    """:func:`paged_mla_prefill` with ``rows`` queries x heads a program (tests vary the split)."""
    check_mla_widths(q_latent, q_pe, latent_cache, pe_cache)
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    check_paged_inputs(num_seqs, block_tables, context_lens)
    check_ndim("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    check_dtype("query_start_loc", query_start_loc, (torch.int32, torch.int64))
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc needs num_seqs + 1 = {num_seqs + 1} entries "
                         f"(got {query_start_loc.shape[0]}).")  # fmt: skip
    check_same_device(q_latent=q_latent, q_pe=q_pe, latent_cache=latent_cache, pe_cache=pe_cache,
                      block_tables=block_tables, query_start_loc=query_start_loc, context_lens=context_lens)  # fmt: skip
    out = torch.empty_like(q_latent)
    num_tokens, num_heads, rank = q_latent.shape
    if num_tokens == 0 or num_seqs == 0:
        return out
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    block_tables, query_start_loc = block_tables.contiguous(), query_start_loc.contiguous()
    block_m, block_h = plan_mla_prefill(num_heads, rows)
    block_c = max(16, triton.next_power_of_2(rank))
    grid = (num_tokens // block_m + num_seqs, triton.cdiv(num_heads, block_h))
    _mla_prefill_kernel[grid](
        q_latent, q_pe, latent_cache, pe_cache, block_tables, query_start_loc, context_lens.contiguous(), out,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        latent_cache.stride(0), latent_cache.stride(1), pe_cache.stride(0), pe_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        num_seqs, num_heads, rank, q_pe.shape[2], scale * LOG2E,
        BLOCK_SIZE=latent_cache.shape[1], BLOCK_M=block_m, BLOCK_H=block_h, BLOCK_C=block_c,
        BLOCK_R=max(16, triton.next_power_of_2(q_pe.shape[2])), BLOCK_N=BLOCK_N,
        DOT_PRECISION=dot_precision(q_latent.dtype), DOT_UPCAST=needs_upcast(q_latent.device),
        num_warps=8 if block_c >= 256 else 4, num_stages=2,  # as bench.gpu.compile_check compiles it
    )  # fmt: skip
    return out
