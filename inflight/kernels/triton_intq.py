"""Triton linear for compressed-tensors pack-quantized weights: ``intq_linear`` with the reference's signature.

The int32 words of :class:`~inflight.kernels.intq_reference.IntQuantWeight` are read inside
the GEMM's inner loop and never dequantized to memory. The structure is the GGUF kernel's
(:mod:`inflight.kernels.triton_quant`), whose launch plan, split-K rule and split-sum kernel
it reuses:

* **Tiling.** A program owns ``[BLOCK_M rows x BLOCK_N out features]`` and walks K in steps of
  ``BLOCK_K`` inputs (64, or 32 when the group size is a multiple of 32 but not of 64). Each
  step loads ``[BLOCK_N, BLOCK_K / per_word]`` int32 words once (8 int4 or 4 int8 values a
  word, so the weight is read at 4 or 8 bits a value), unpacks them in registers by shifting
  every word by each value's bit offset (``[BLOCK_N, words, per_word]``, reshaped to
  ``[BLOCK_N, BLOCK_K]``), dequantizes, and accumulates ``x_tile @ w_tile.T`` in fp32 with
  ``tl.dot``. Rows, out features, and inputs past ``in_features`` (which need not be a
  multiple of 8) are masked.
* **Scales and zero points.** When ``BLOCK_K`` divides the group size (or the weight is
  channel-wise) a step lies in one group: one ``[BLOCK_N]`` scale and zero point per step.
  Other group sizes (any divisor of ``in_features`` is legal) gather them per weight.
* **Few rows (decode batches).** :func:`~inflight.kernels.triton_quant.plan_quant_linear`'s
  plan: ``BLOCK_M`` 16, ``BLOCK_N`` 32 and a K split from the shapes and the SM count (each
  range >= 128 inputs); the ranges write fp32 partials and ``_sum_splits_kernel`` adds them
  and the bias and rounds once.

Rounding points match the reference exactly: ``(q - zero) * scale`` is exact in fp32 for a
16-bit scale (a 9-bit integer times an 8- or 11-bit significand), then rounded to nearest even
to the scale's dtype (compressed-tensors multiplies in that dtype), then to x's dtype (the
reference's ``.to(x.dtype)``); fp32 scales give torch's one fp32 rounding. The interpreter
truncates fp32 -> bf16, so there (``SOFT_BF16``) the kernel rounds to bf16 with integer ops;
on the GPU ``cvt.rn`` does it. Accumulation is fp32, the bias (in x's dtype) is added in fp32
and the output is rounded once. Launch sizes come from shapes and the SM count only (nothing
read on the host), so a decode step using it can be captured in a CUDA graph. Knows nothing
about checkpoints or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inflight.kernels.intq_reference import IntQuantWeight
from inflight.kernels.triton_common import (
    cdiv,
    num_sms,
)
from inflight.kernels.triton_helpers import dot, dot_precision, needs_upcast
from inflight.kernels.triton_quant import check_packed_linear, plan_quant_linear, split_target, sum_splits


@dataclass(frozen=True, slots=True)
class IntQuantPlan:
    """Tile sizes and the K split of one launch (a function of shapes only)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def block_k_for(group_size: int, num_groups: int) -> int:
    """The K step: 64 where a step stays inside one group, else 32 (a step inside a group
    when the group size is a multiple of 32; otherwise scales are gathered per weight)."""
    return 64 if num_groups == 1 or group_size % 64 == 0 else 32


def plan_intq_linear(num_rows: int, out_features: int, in_features: int, group_size: int, sms: int) -> IntQuantPlan:
    """The GGUF kernel's plan (rows, features, split) with this format's K step."""
    base = plan_quant_linear(num_rows, out_features, in_features, sms)
    block_k = block_k_for(group_size, max(1, in_features // group_size))
    return IntQuantPlan(base.block_m, base.block_n, block_k, base.split_k, base.num_warps, base.num_stages)


@triton.jit
def _round_to(w, DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """fp32 ``w`` rounded to nearest even in ``DTYPE``, still fp32. ``SOFT_BF16``: bf16 by
    integer ops (the interpreter's fp32 -> bf16 cast truncates); finite inputs only."""
    if DTYPE == tl.float32:
        rounded = w
    elif DTYPE == tl.bfloat16 and SOFT_BF16:
        bits = w.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        rounded = bits.to(tl.float32, bitcast=True)
    else:
        rounded = w.to(DTYPE).to(tl.float32)
    return rounded


@triton.jit
def _dequantize_tile(
    packed_ptr,  # [N, row_words] int32
    scale_ptr,  # [N, num_groups]
    zero_ptr,  # [N, num_groups] int8 (read when HAS_ZERO)
    offs_n,  # [BLOCK_N] int64
    n_mask,  # [BLOCK_N]
    step,  # which BLOCK_K inputs
    K,
    row_words,
    num_groups,
    group_size,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    GROUP_STEP: tl.constexpr,  # the step lies inside one group
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``[BLOCK_N, BLOCK_K]`` weights as fp32, ``(q - zero) * scale`` before any rounding."""
    offs_w = step * (BLOCK_K // (32 // BITS)) + tl.arange(0, BLOCK_K // (32 // BITS))  # [BLOCK_KW]
    w_mask = n_mask[:, None] & (offs_w < row_words)[None, :]
    words = tl.load(packed_ptr + offs_n[:, None] * row_words + offs_w[None, :], mask=w_mask, other=0)  # [BLOCK_N, BLOCK_KW]
    shifts = tl.arange(0, 32 // BITS) * BITS  # [per_word]: value j of a word sits at bit j * BITS
    u = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)  # [BLOCK_N, BLOCK_KW, per_word]
    q = tl.reshape(u, (BLOCK_N, BLOCK_K)).to(tl.float32) - (1 << (BITS - 1))  # [BLOCK_N, BLOCK_K]
    groups = offs_n * num_groups  # [BLOCK_N] int64
    if GROUP_STEP:
        g = (step * BLOCK_K) // group_size
        s = tl.load(scale_ptr + groups + g, mask=n_mask, other=0.0).to(tl.float32)[:, None]  # [BLOCK_N, 1]
        if HAS_ZERO:
            q -= tl.load(zero_ptr + groups + g, mask=n_mask, other=0).to(tl.float32)[:, None]
    else:
        offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        at = groups[:, None] + (offs_k // group_size)[None, :]  # [BLOCK_N, BLOCK_K]
        mask = n_mask[:, None] & (offs_k < K)[None, :]
        s = tl.load(scale_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZERO:
            q -= tl.load(zero_ptr + at, mask=mask, other=0).to(tl.float32)
    return q * s


@triton.jit
def _intq_linear_kernel(
    x_ptr,  # [M, K]
    packed_ptr,  # [N, row_words] int32
    scale_ptr,  # [N, num_groups] fp16 | bf16 | fp32
    zero_ptr,  # [N, num_groups] int8 (read when HAS_ZERO)
    bias_ptr,  # [N] in x's dtype (read when HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype, or [split_k, M, N] float32 partials
    M,
    N,
    K,
    row_words,
    num_groups,
    group_size,
    steps_per_split,  # BLOCK_K steps each program sums over
    num_steps,  # cdiv(K, BLOCK_K)
    stride_xm,
    BITS: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_STEP: tl.constexpr,
    SOFT_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, num_steps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, last):
        k = step * BLOCK_K + offs_k  # [BLOCK_K]
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = _dequantize_tile(packed_ptr, scale_ptr, zero_ptr, offs_n.to(tl.int64), n_mask, step, K, row_words,
                             num_groups, group_size, BITS, HAS_ZERO, GROUP_STEP, BLOCK_N, BLOCK_K)  # [BLOCK_N, BLOCK_K]
        w = _round_to(w, scale_ptr.dtype.element_ty, SOFT_BF16)  # compressed-tensors' product
        w = _round_to(w, x_ptr.dtype.element_ty, SOFT_BF16)  # the reference's .to(x.dtype)
        acc += dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), PRECISION, UPCAST)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    offs_out = (split * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def intq_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: IntQuantWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    """``x @ dequantize(weight).T + bias`` in x's dtype (see :func:`intq_reference.intq_linear`)."""
    tensors = {"weight_packed": weight.weight_packed, "weight_scale": weight.weight_scale}
    if weight.weight_zero_point is not None:
        tensors["weight_zero_point"] = weight.weight_zero_point
    check_packed_linear(x, weight.shape, bias, **tensors)
    out_features, in_features = weight.shape
    plan = plan_intq_linear(x.shape[0], out_features, in_features, weight.group_size, num_sms(x.device))
    return _launch(x, weight, bias, plan)


def _launch(x: torch.Tensor, weight: IntQuantWeight, bias: torch.Tensor | None, plan: IntQuantPlan) -> torch.Tensor:
    (num_rows, in_features), out_features = x.shape, weight.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    if out.numel() == 0 or in_features == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    x = x.contiguous()
    packed = weight.weight_packed.contiguous()  # [N, row_words]
    scale = weight.weight_scale.contiguous()  # [N, num_groups]
    zero = scale if weight.weight_zero_point is None else weight.weight_zero_point.contiguous()
    num_steps = cdiv(in_features, plan.block_k)
    split_k = min(plan.split_k, num_steps)
    steps_per_split = cdiv(num_steps, split_k)
    target = split_target(out, split_k)
    grid = (cdiv(num_rows, plan.block_m), cdiv(out_features, plan.block_n), split_k)
    _intq_linear_kernel[grid](
        x, packed, scale, zero, out if bias is None else bias, target,
        num_rows, out_features, in_features, packed.shape[1], weight.num_groups, weight.group_size,
        steps_per_split, num_steps, x.stride(0),
        BITS=weight.num_bits, HAS_ZERO=weight.weight_zero_point is not None,
        HAS_BIAS=bias is not None and split_k == 1,
        GROUP_STEP=weight.num_groups == 1 or weight.group_size % plan.block_k == 0,
        SOFT_BF16=needs_upcast(x.device), PRECISION=dot_precision(x.dtype), UPCAST=needs_upcast(x.device),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return sum_splits(target, out, bias, split_k)
