"""Triton linear for GGUF block-quantized weights: ``quant_linear`` with the reference's signature.

The packed bytes of :class:`~inflight.kernels.quant_reference.QuantizedWeight` are read inside
the GEMM's inner loop and never dequantized to memory. One kernel serves every row count:

* **Tiling.** A program owns ``[BLOCK_M rows x BLOCK_N out features]`` and walks K one GGUF
  block (32 weights) at a time: it loads that block's ``[32, BLOCK_N]`` quant bytes (a nibble
  byte is read for weight ``i`` and ``i + 16``, the second read hitting L1) and its
  ``[BLOCK_N]`` fp16 scales, unpacks and scales in fp32 registers exactly as the reference
  does, rounds to x's dtype (as the reference's ``.to(x.dtype)``) and accumulates
  ``x_tile @ w_tile`` in fp32 with ``tl.dot``. in_features is always a multiple of 32, so
  the K loop needs no mask; rows and out features past the end are masked.
* **Few rows (decode batches, M <= SPLIT_ROWS).** The same kernel, ``BLOCK_M`` 16 for up to
  16 rows (tl.dot's smallest tile: the padding costs nothing, the step is bound by weight
  bytes), a narrower ``BLOCK_N``, and split-K: tiles alone give too few programs to keep the
  memory system busy (4096 features / 32 = 128 programs on 132 SMs), so K is cut into
  ``split_k`` ranges (about two programs per SM, each range >= 128 weights) chosen from the
  shapes and the SM count. Each range writes fp32 partial sums to a ``[split_k, M, N]``
  workspace and a small kernel adds them and the bias and rounds once. A GEMV without
  ``tl.dot`` would save the padding's FLOPs but not one byte of weight traffic.
* **Scales** are read through an fp16 view of the same bytes (every block and every scale
  sits at an even byte offset), so the kernel loads them as fp16, in the interpreter and on
  the GPU alike; Q8_0's quants are bit-cast from uint8 to int8 in registers.
* **K-quants** (Q4_K, Q5_K, Q6_K) walk the same 32-weight steps: step ``b`` is sub-block
  ``b % 8`` of super-block ``b // 8``, whose 6-bit (Q6_K: int8) sub-scales are unpacked per
  step beside the fp16 super-block scales.

Launch sizes come from tensor shapes and the device's SM count only (nothing read on the
host), so a decode step using it can be captured in a CUDA graph. Rounding points match the
reference: weights rounded to x's dtype, fp32 accumulation, bias (in x's dtype) added in fp32,
one rounding of the output. Weight bytes are read with byte loads (a block is only 2-byte
aligned); a repacked layout would allow wider ones. Types outside ``QTYPES`` run the reference.
Knows nothing about GGUF files or models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inflight.kernels import quant_reference
from inflight.kernels.quant_reference import (
    BLOCK_BYTES,
    BLOCK_SIZE,
    BLOCK_WEIGHTS,
    QTYPE_IDS,
    QuantizedWeight,
)
from inflight.kernels.triton_common import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_ndim,
    check_same_device,
    num_sms,
)
from inflight.kernels.triton_helpers import dot, dot_precision, needs_upcast

SPLIT_ROWS = 64  # up to this many rows, tiles over out features alone are too few: split K
MAX_SPLIT_K = 16
MIN_BLOCKS_PER_SPLIT = 4  # each K range spans >= 128 weights, so partials stay small
REDUCE_BLOCK = 1024
QTYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # others run the reference


@dataclass(frozen=True, slots=True)
class QuantPlan:
    """Tile sizes and the K split of one launch (a function of shapes only)."""

    block_m: int
    block_n: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def plan_quant_linear(num_rows: int, out_features: int, in_features: int, sms: int) -> QuantPlan:
    """The launch plan: see the module docstring."""
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    if num_rows > SPLIT_ROWS:
        return QuantPlan(block_m=block_m, block_n=64, split_k=1)
    tiles = max(1, cdiv(num_rows, block_m) * cdiv(out_features, 32))
    most = max(1, min(MAX_SPLIT_K, in_features // BLOCK_SIZE // MIN_BLOCKS_PER_SPLIT))
    return QuantPlan(block_m=block_m, block_n=32, split_k=max(1, min(most, cdiv(2 * sms, tiles))))


@triton.jit
def _dequantize_block(
    quants_ptr,  # uint8 bytes of the weight, [N, row_bytes]
    halves_ptr,  # the same bytes as fp16, [N, row_bytes / 2]
    base,  # [BLOCK_N] int64 byte offset of this (super-)block in each weight row
    j,  # which 32-weight sub-block of a K-quant super-block (0 for the 32-weight types)
    n_mask,  # [BLOCK_N]
    QTYPE: tl.constexpr,  # quant_reference.QTYPE_IDS: Q4_0 Q4_1 Q8_0 Q4_K Q5_K Q6_K = 0..5
):
    """32 weights of BLOCK_N weight rows as a ``[32, BLOCK_N]`` fp32 tile (gguf's arithmetic)."""
    offs_i = tl.arange(0, 32)[:, None]  # weight index inside the (sub-)block
    mask = n_mask[None, :]
    row = base[None, :]
    if QTYPE >= 3:
        w = _dequantize_k_sub_block(quants_ptr, halves_ptr, base, j, n_mask, QTYPE)
    elif QTYPE == 2:
        d = tl.load(halves_ptr + row // 2, mask=mask, other=0.0).to(tl.float32)
        raw = tl.load(quants_ptr + row + 2 + offs_i, mask=mask, other=0)
        w = raw.to(tl.int8, bitcast=True).to(tl.float32) * d
    else:
        d = tl.load(halves_ptr + row // 2, mask=mask, other=0.0).to(tl.float32)
        byte = tl.load(quants_ptr + row + (2 + 2 * QTYPE) + offs_i % 16, mask=mask, other=0)
        q = ((byte.to(tl.int32) >> (offs_i // 16) * 4) & 0xF).to(tl.float32)  # [32, BLOCK_N]
        if QTYPE == 0:
            w = d * (q - 8.0)
        else:
            w = d * q + tl.load(halves_ptr + row // 2 + 1, mask=mask, other=0.0).to(tl.float32)
    return w


@triton.jit
def _dequantize_k_sub_block(quants_ptr, halves_ptr, base, j, n_mask, QTYPE: tl.constexpr):
    """Sub-block ``j`` of a Q4_K/Q5_K/Q6_K super-block as ``[32, BLOCK_N]`` fp32 (layouts in
    :mod:`inflight.kernels.quant_reference`)."""
    offs_i = tl.arange(0, 32)[:, None]
    mask = n_mask[None, :]
    row = base[None, :]
    if QTYPE == 5:  # Q6_K: weight e = 32 j + i = 128 h + 32 t + i
        h, t = j // 4, j % 4
        low = tl.load(quants_ptr + row + 64 * h + 32 * (t % 2) + offs_i, mask=mask, other=0).to(tl.int32)
        high = tl.load(quants_ptr + row + 128 + 32 * h + offs_i, mask=mask, other=0).to(tl.int32)
        q = ((low >> 4 * (t // 2)) & 0xF) | (((high >> 2 * t) & 3) << 4)
        sc = tl.load(quants_ptr + row + 192 + 2 * j + offs_i // 16, mask=mask, other=0)
        d = tl.load(halves_ptr + row // 2 + 104, mask=mask, other=0.0).to(tl.float32)
        w = (d * sc.to(tl.int8, bitcast=True).to(tl.float32)) * (q.to(tl.float32) - 32.0)
    else:  # Q4_K / Q5_K: 6-bit scale and min of sub-block j from the 12 bytes at 4
        jj = j % 4
        a = tl.load(quants_ptr + base + 4 + jj, mask=n_mask, other=0).to(tl.int32)  # [BLOCK_N]
        b = tl.load(quants_ptr + base + 8 + jj, mask=n_mask, other=0).to(tl.int32)
        c = tl.load(quants_ptr + base + 12 + jj, mask=n_mask, other=0).to(tl.int32)
        sc = tl.where(j < 4, a & 0x3F, (c & 0xF) | ((a >> 2) & 0x30)).to(tl.float32)
        mn = tl.where(j < 4, b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)).to(tl.float32)
        ds = tl.load(halves_ptr + base // 2, mask=n_mask, other=0.0).to(tl.float32) * sc
        dm = tl.load(halves_ptr + base // 2 + 1, mask=n_mask, other=0.0).to(tl.float32) * mn
        byte = tl.load(quants_ptr + row + (16 + 32 * (QTYPE - 3)) + 32 * (j // 2) + offs_i, mask=mask, other=0).to(tl.int32)
        q = (byte >> 4 * (j % 2)) & 0xF
        if QTYPE == 4:
            fifth = tl.load(quants_ptr + row + 16 + offs_i, mask=mask, other=0).to(tl.int32)
            q = q | (((fifth >> j) & 1) << 4)
        w = ds[None, :] * q.to(tl.float32) - dm[None, :]
    return w


@triton.jit
def _quant_linear_kernel(
    x_ptr,  # [M, K]
    quants_ptr,  # [N, row_bytes] uint8
    halves_ptr,  # [N, row_bytes / 2] fp16 view of the same bytes
    bias_ptr,  # [N] in x's dtype (read when HAS_BIAS)
    out_ptr,  # [M, N] in x's dtype, or [split_k, M, N] float32 partials
    M,
    N,
    row_bytes,
    blocks_per_split,  # 32-weight (sub-)blocks of K each program sums over
    num_blocks,  # K / 32
    stride_xm,
    QTYPE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,  # bytes per block (K-quants: per 256-weight super-block)
    SUB_BLOCKS: tl.constexpr,  # 32-weight sub-blocks per block: 1, or 8 for the K-quants
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, 32)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, 32]
    w_rows = offs_n.to(tl.int64) * row_bytes  # [BLOCK_N]
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_blocks)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(first, last):
        x = tl.load(x_rows + b * 32, mask=m_mask[:, None], other=0.0)  # [BLOCK_M, 32]
        base = w_rows + (b // SUB_BLOCKS) * BLOCK_BYTES  # [BLOCK_N] int64
        w = _dequantize_block(quants_ptr, halves_ptr, base, b % SUB_BLOCKS, n_mask, QTYPE)  # [32, BLOCK_N]
        acc += dot(x, w.to(x_ptr.dtype.element_ty), PRECISION, UPCAST)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    offs_out = (split * M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptr + offs_out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(
    partial_ptr,  # [split_k, M * N] float32
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M * N] in x's dtype
    num_elements,
    N,
    split_k,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_elements
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(split_k):
        acc += tl.load(partial_ptr + s * num_elements + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_packed_linear(x: torch.Tensor, shape: tuple[int, int], bias: torch.Tensor | None,
                        **weight_tensors: torch.Tensor) -> None:
    """The inputs of a packed-weight linear (this module's and :mod:`triton_intq`'s): ``x``
    ``[num_rows, in]`` in a float dtype, ``bias`` ``[out]``, all on one device."""
    out_features, in_features = shape
    check_ndim("x", x, 2, "[num_rows, in_features]")
    check_dtype("x", x, FLOAT_DTYPES)
    if x.shape[1] != in_features:
        raise ValueError(f"x has {x.shape[1]} features but the weight takes {in_features}.")
    check_same_device(x=x, **weight_tensors, **({} if bias is None else {"bias": bias}))
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"bias must be [out_features={out_features}] (got {tuple(bias.shape)}).")


def quant_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    """``x @ dequantize(weight).T + bias`` in x's dtype (see :func:`quant_reference.quant_linear`)."""
    check_packed_linear(x, weight.shape, bias, blocks=weight.blocks)
    if weight.qtype not in QTYPES:
        return quant_reference.quant_linear(x, weight, bias)
    num_rows, out_features = x.shape[0], weight.shape[0]
    plan = plan_quant_linear(num_rows, out_features, weight.in_features, num_sms(x.device))
    return _launch(x, weight, bias, plan)


def _launch(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, plan: QuantPlan) -> torch.Tensor:
    num_rows, out_features = x.shape[0], weight.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    if out.numel() == 0 or weight.in_features == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    x = x.contiguous()
    quants = weight.blocks.contiguous()
    if quants.storage_offset() % 2:  # the fp16 view needs an even byte offset
        quants = quants.clone()
    num_blocks = weight.in_features // BLOCK_SIZE
    split_k = min(plan.split_k, num_blocks)
    blocks_per_split = cdiv(num_blocks, split_k)
    target = split_target(out, split_k)
    grid = (cdiv(num_rows, plan.block_m), cdiv(out_features, plan.block_n), split_k)
    _quant_linear_kernel[grid](
        x, quants, quants.view(torch.float16), out if bias is None else bias, target,
        num_rows, out_features, quants.shape[1], blocks_per_split, num_blocks, x.stride(0),
        QTYPE=QTYPE_IDS[weight.qtype], BLOCK_BYTES=BLOCK_BYTES[weight.qtype],
        SUB_BLOCKS=BLOCK_WEIGHTS[weight.qtype] // BLOCK_SIZE, HAS_BIAS=bias is not None and split_k == 1,
        PRECISION=dot_precision(x.dtype), UPCAST=needs_upcast(x.device),
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )  # fmt: skip
    return sum_splits(target, out, bias, split_k)


def split_target(out: torch.Tensor, split_k: int) -> torch.Tensor:
    """Where a GEMM launch writes: ``out`` itself, or ``[split_k, *out.shape]`` fp32 partials."""
    return out if split_k == 1 else torch.empty((split_k, *out.shape), dtype=torch.float32, device=out.device)


def sum_splits(target: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, split_k: int) -> torch.Tensor:
    """``out`` with the split-K partials in ``target`` summed (and ``bias`` added) once."""
    if split_k > 1:
        _sum_splits_kernel[(cdiv(out.numel(), REDUCE_BLOCK),)](
            target, out if bias is None else bias, out, out.numel(), out.shape[1], split_k,
            HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK,
        )  # fmt: skip
    return out
