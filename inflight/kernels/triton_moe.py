"""Triton fused mixture-of-experts MLP: ``fused_moe`` with the reference's signature.

As vLLM's ``fused_moe``: the ``num_tokens * top_k`` (token, expert) pairs are sorted by expert
and each expert's group padded to a multiple of ``BLOCK_M`` (:func:`align_pairs`, torch ops with
no host read), so every ``BLOCK_M`` rows of the sorted order belong to one expert; one grouped
GEMM kernel then runs ``gate_up = x @ w13[e].T`` over them, SiLU-and-mul follows, and the same
kernel runs ``down = act @ w2[e].T`` scaled by each pair's routing weight; the top-k outputs of a
token are summed in float32. Launch sizes depend on shapes only (blocks past the padded end
exit at once), so the whole op can be captured in a CUDA graph. Rounding points match the
reference: each GEMM rounds to the input dtype, weighting and the top-k sum run in float32.
gpt-oss's options: per-expert biases are added to each GEMM's float32 accumulator before it
rounds (as ``F.linear`` with a bias), and its :class:`~inflight.kernels.reference.ClampedSwiglu`
runs as the reference's elementwise torch ops (graph-safe) in place of SiLU-and-mul.
Knows nothing about routing or the model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.reference import ClampedSwiglu, clamped_swiglu
from inflight.kernels.triton_activation import silu_and_mul
from inflight.kernels.triton_common import FLOAT_DTYPES, INDEX_DTYPES, cdiv, check_dtype, check_ndim
from inflight.kernels.triton_helpers import dot, dot_precision, needs_upcast

BLOCK_M = 16  # rows (token, expert pairs) per program: the smallest tl.dot tile
BLOCK_N = 64
BLOCK_K = 32


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, each expert's group padded to ``block_m`` rows.

    Returns ``sorted_pairs`` ``[max_rows]`` int32 (pair ``t * top_k + j``; ``num_pairs`` marks
    padding) and ``block_expert`` ``[max_rows / block_m]`` int32 (the expert of each block of
    rows; ``num_experts`` for blocks past the end). ``max_rows`` bounds the padded length from
    the shapes alone, so nothing is read on the host.
    """
    flat = topk_ids.reshape(-1).long()  # [num_pairs]
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [num_experts]
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    max_rows = cdiv(min(num_pairs + num_experts * (block_m - 1), num_pairs * block_m), block_m) * block_m
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[(padded_end - padded)[experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


@triton.jit
def load_block_rows(sorted_ptr, num_entries, BLOCK_M: tl.constexpr):
    """The other half of :func:`align_pairs`, inside a kernel whose program 0-axis walks its blocks
    of rows (after the caller has checked the block's group): this block's ``BLOCK_M`` positions
    in the sorted order, the int32 entries there, and which of them are real (not padding)."""
    pos = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    entry = tl.load(sorted_ptr + pos)
    return pos, entry, entry < num_entries


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [num_rows_a, K]: rows read for pair p are p // A_ROWS_PER_ROW
    w_ptr,  # [num_experts, N, K]
    bias_ptr,  # [num_experts, N] (read when HAS_BIAS)
    out_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] float32 routing weights (read when MUL_WEIGHT)
    sorted_pairs_ptr,  # [max_rows] int32
    block_expert_ptr,  # [max_rows / BLOCK_M] int32
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    NUM_EXPERTS: tl.constexpr,
    A_ROWS_PER_ROW: tl.constexpr,  # top_k for the first GEMM (rows of x), 1 for the second
    MUL_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= NUM_EXPERTS:
        return
    _, pair, valid = load_block_rows(sorted_pairs_ptr, num_pairs, BLOCK_M)
    a_row = (pair // A_ROWS_PER_ROW).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += dot(a, w, PRECISION, UPCAST)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    out = acc.to(a_ptr.dtype.element_ty)  # the reference rounds each expert's matmul
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
        out = out.to(tl.float32) * weight[:, None]
    offs_out = pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptr + offs_out, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, weights: torch.Tensor,
    sorted_pairs: torch.Tensor, block_expert: torch.Tensor, rows_per_row: int, mul_weight: bool,
) -> None:
    num_pairs, n = out.shape
    grid = (block_expert.shape[0], cdiv(n, BLOCK_N))
    bias_arg = weights if bias is None else bias  # a placeholder the kernel never reads
    _grouped_gemm_kernel[grid](
        a, w, bias_arg, out, weights, sorted_pairs, block_expert, num_pairs, n, a.shape[1],
        a.stride(0), w.stride(0), w.stride(1), 0 if bias is None else bias.stride(0), out.stride(0),
        NUM_EXPERTS=w.shape[0], A_ROWS_PER_ROW=rows_per_row, MUL_WEIGHT=mul_weight, HAS_BIAS=bias is not None,
        PRECISION=dot_precision(a.dtype), UPCAST=needs_upcast(a.device),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip


def fused_moe(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: each expert's gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32 or int64
    *,
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * intermediate] (gate, then up)
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    activation: ClampedSwiglu | None = None,  # None: silu(gate) * up
) -> torch.Tensor:  # [num_tokens, hidden]
    """Mixture-of-experts SwiGLU MLP (see :func:`inflight.kernels.reference.fused_moe`)."""
    check_ndim("hidden", hidden, 2, "[num_tokens, hidden]")
    check_ndim("w13", w13, 3, "[num_experts, 2 * intermediate, hidden]")
    check_ndim("w2", w2, 3, "[num_experts, hidden, intermediate]")
    check_dtype("hidden", hidden, FLOAT_DTYPES)
    check_dtype("topk_ids", topk_ids, INDEX_DTYPES)
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden_size, width = w2.shape
    if w13.shape != (num_experts, 2 * width, hidden_size) or hidden.shape[1] != hidden_size:
        raise ValueError(f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} and hidden {tuple(hidden.shape)} disagree.")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"expert weights ({w13.dtype}, {w2.dtype}) must have hidden's dtype {hidden.dtype}.")
    for name, bias, shape in (("w13_bias", w13_bias, w13.shape[:2]), ("w2_bias", w2_bias, w2.shape[:2])):
        if bias is not None and (bias.shape != shape or bias.dtype != hidden.dtype):
            raise ValueError(f"{name} must be {tuple(shape)} {hidden.dtype} (got {tuple(bias.shape)} {bias.dtype}).")
    if num_tokens == 0:
        return torch.empty_like(hidden)
    hidden, w13, w2 = hidden.contiguous(), w13.contiguous(), w2.contiguous()
    w13_bias = None if w13_bias is None else w13_bias.contiguous()
    w2_bias = None if w2_bias is None else w2_bias.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()  # [num_pairs]
    sorted_pairs, block_expert = align_pairs(topk_ids, num_experts, BLOCK_M)
    num_pairs = num_tokens * top_k
    gate_up = torch.empty((num_pairs, 2 * width), dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, w13_bias, gate_up, weights, sorted_pairs, block_expert, top_k, mul_weight=False)
    act = silu_and_mul(gate_up) if activation is None else clamped_swiglu(gate_up, activation)  # [num_pairs, width]
    down = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    _grouped_gemm(act, w2, w2_bias, down, weights, sorted_pairs, block_expert, 1, mul_weight=True)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
