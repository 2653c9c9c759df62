"""Triton fused RMSNorm (+ residual add) and neox-style rotary embedding.

Owns ``rms_norm`` and ``rotary_embedding`` (same signatures and rounding points as the
references: the residual sum is rounded to the input dtype before the norm, the normed value
is rounded to the input dtype before the weight multiply). Each replaces a chain of eager
torch ops with one pass over memory. Knows nothing about the model's layout beyond shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.triton_common import (
    FLOAT_DTYPES,
    check_dtype,
    check_ndim,
    check_same_device,
    next_power_of_2,
)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [n0, n1, hidden] (a 2-D input has n1 == 1)
    residual_ptr,  # [n0, n1, hidden] (HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [n0 * n1, hidden] contiguous
    new_residual_ptr,  # [n0 * n1, hidden] contiguous (HAS_RESIDUAL)
    n1,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i, j = row // n1, row % n1
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + i * stride_r0 + j * stride_r1 + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * hidden + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / hidden
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(n1, stride0, stride1) of ``t`` seen as [n0, n1, hidden], last dim made dense first."""
    if t.dim() == 2:
        return 1, t.stride(0), 0
    return t.shape[1], t.stride(0), t.stride(1)


def _check_rms_norm_inputs(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None
) -> None:
    if x.dim() not in (2, 3):
        raise ValueError(
            f"x must be [num_tokens, hidden] or [num_tokens, num_heads, head_dim] (got {tuple(x.shape)})."
        )
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [{x.shape[-1]}] (got {tuple(weight.shape)}).")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}); got "
            f"{tuple(residual.shape)}, {residual.dtype}."
        )
    extra = {"residual": residual} if residual is not None else {}
    check_same_device(x=x, weight=weight, **extra)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden] (or [num_tokens, num_heads, head_dim]: qk-norm)
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # like x
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x + residual``; returns (normed, the new residual ``x + residual``)."""
    _check_rms_norm_inputs(x, weight, residual)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if residual is None:
        new_residual, residual_in = x, x
    else:
        residual_in = residual if residual.stride(-1) == 1 else residual.contiguous()
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    hidden = x.shape[-1]
    num_rows = x.numel() // hidden if hidden else 0
    if num_rows == 0:
        return out, new_residual
    n1, stride_x0, stride_x1 = _row_strides(x)
    _, stride_r0, stride_r1 = _row_strides(residual_in)
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x, residual_in, weight, out, new_residual,
        n1, stride_x0, stride_x1, stride_r0, stride_r1,
        hidden, eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )  # fmt: skip
    return out, new_residual


@triton.jit
def _rotate_heads(
    x_ptr,  # one token's [num_heads, head_dim] input
    out_ptr,  # one token's [num_heads, head_dim] output
    stride_xh,
    stride_oh,
    num_heads,
    head_dim,
    cos,  # [BLOCK_D] fp32, cos for feature d (1 outside the rotary dims)
    sin,  # [BLOCK_D] fp32, signed: -sin for the first half, +sin for the second, 0 outside
    partner,  # [BLOCK_D] the feature rotated into d (d + half or d - half; d outside)
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    rows = offs_h[:, None] * stride_xh
    x = tl.load(x_ptr + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    out = x * cos[None, :] + xp * sin[None, :]
    o_offs = offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr,  # [max_position, rotary_dim] fp32
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    num_heads,
    num_kv_heads,
    head_dim,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    first = offs_d < HALF
    rotated = offs_d < 2 * HALF
    freq = tl.where(first, offs_d, offs_d - HALF)
    row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(row + freq, mask=rotated, other=1.0)
    sin = tl.load(row + HALF + freq, mask=rotated, other=0.0)
    sin = tl.where(first, -sin, sin)
    partner = tl.where(first, offs_d + HALF, tl.where(rotated, offs_d - HALF, offs_d))
    _rotate_heads(q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_qh, stride_qoh,
                  num_heads, head_dim, cos, sin, partner, BLOCK_HQ, BLOCK_D)  # fmt: skip
    _rotate_heads(k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_kh, stride_koh,
                  num_kv_heads, head_dim, cos, sin, partner, BLOCK_HK, BLOCK_D)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, rotary_dim] (cos half, then sin half), fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding over the first ``rotary_dim`` features."""
    check_ndim("positions", positions, 1, "[num_tokens]")
    check_ndim("query", query, 3, "[num_tokens, num_heads, head_dim]")
    check_ndim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    check_ndim("cos_sin_cache", cos_sin_cache, 2, "[max_position, rotary_dim]")
    check_dtype("positions", positions, (torch.int32, torch.int64))
    num_tokens, num_heads, head_dim = query.shape
    rotary_dim = cos_sin_cache.shape[1]
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or positions.shape[0] != num_tokens:
        raise ValueError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)} and positions "
            f"{tuple(positions.shape)} must agree on num_tokens and head_dim."
        )
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim ({rotary_dim}) must be even and <= head_dim ({head_dim}).")
    check_same_device(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    cos_sin_cache = cos_sin_cache.contiguous()
    q_out, k_out = torch.empty_like(query), torch.empty_like(key)
    if num_tokens == 0:
        return q_out, k_out
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache, q_out, k_out,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin_cache.stride(0),
        num_heads, key.shape[1], head_dim,
        HALF=rotary_dim // 2,
        BLOCK_HQ=next_power_of_2(num_heads),
        BLOCK_HK=next_power_of_2(key.shape[1]),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=4 if num_heads * head_dim <= 4096 else 8,
    )  # fmt: skip
    return q_out, k_out
