"""Small ``@triton.jit`` helpers shared by the attention kernels.

Owns the one matmul wrapper the kernels use, so the interpreter work-around lives in one
place. Knows nothing about attention.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``UPCAST`` (interpreter only) multiplies in fp32:
    Triton's interpreter multiplies bf16 operands as their raw uint16 bit patterns."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE fp32 products for fp32 inputs (no silent TF32); 16-bit inputs ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def needs_upcast(device: torch.device) -> bool:
    """Off CUDA the kernels run in the interpreter, whose bf16 ``tl.dot`` is wrong."""
    return device.type != "cuda"


@triton.jit
def load_kv_tile(
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    table_row,  # this sequence's row of the block table
    pos,  # [BLOCK_N] token positions
    n_mask,  # [BLOCK_N] which positions to load
    kv_head,
    stride_cb,
    stride_cs,
    stride_ch,
    offs_d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D]
    BLOCK_SIZE: tl.constexpr,
):
    """Gather ``[BLOCK_N, BLOCK_D]`` K and V tiles for ``pos`` through the block table."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    offs = row[:, None] + offs_d[None, :]
    mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offs, mask=mask, other=0.0)
    return k, v


@triton.jit
def online_softmax_step(
    q,  # [M, BLOCK_D]
    k,  # [N, BLOCK_D]
    v,  # [N, BLOCK_D]
    visible,  # [M, N] which scores count
    qk_scale,  # softmax scale * log2(e)
    m_i,  # [M] running max (log2 domain)
    l_i,  # [M] running sum of exp2
    acc,  # [M, BLOCK_D] fp32 running numerator
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Fold one K/V tile into the running (max, sum, numerator); returns the new triple.
    Rows with nothing visible yet keep max -inf and contribute nothing (no NaN)."""
    qk = dot(q, tl.trans(k.to(q.dtype)), PRECISION, UPCAST) * qk_scale
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc
