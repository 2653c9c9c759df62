"""Triton multi-LoRA delta: ``lora_delta`` with the reference's signature
(:func:`inflight.kernels.lora_reference.lora_delta`).

Punica/S-LoRA's segmented idea, in two grouped GEMMs: the rows are sorted by adapter slot and
each slot's group padded to a multiple of ``BLOCK_M`` (:func:`~.triton_moe.align_pairs`, torch
ops with no host read; rows with slot -1 form a group of their own that no program works on),
so every ``BLOCK_M`` rows of the sorted order belong to one slot. The *shrink* kernel then runs
``x[rows] @ a[s].T`` into a float32 ``[rows, rank]`` buffer (its K loop split over a few
programs when there are few rows: :func:`plan_split_k`), and the *expand* kernel runs
``buffer @ b[s].T`` (the splits' partial sums added first), adds ``out[rows]`` in float32 and
stores the sum rounded to ``out``'s dtype through ``out``'s strides (a column slice of a fused
output is fine). Launch sizes come
from shapes only (blocks past the padded end exit at once), so the op can be captured in a
CUDA graph. Knows nothing about adapters, their files or their scaling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.lora_reference import check_lora_inputs
from inflight.kernels.triton_common import cdiv, next_power_of_2, num_sms
from inflight.kernels.triton_helpers import dot, dot_precision, needs_upcast
from inflight.kernels.triton_moe import align_pairs, load_block_rows

BLOCK_M = 16  # rows per program: the smallest tl.dot tile
BLOCK_N = 64  # output features per expand program
BLOCK_K = 64  # input features per shrink step
MAX_SPLIT_K = 8  # the shrink's K loop split over at most this many programs per block of rows ...
MIN_STEPS_PER_SPLIT = 4  # ... each with at least this many BLOCK_K steps


def plan_split_k(num_blocks: int, in_features: int, sms: int) -> int:
    """How many programs share one block of rows' shrink (its K loop), from shapes alone: a
    decode step has few blocks of rows and a long K (hidden size), so without a split a few
    programs would loop over all of K while the rest of the GPU idles. The partial sums land in
    their own slices of the float32 buffer and the expand adds them (deterministic: no atomics)."""
    by_k = cdiv(in_features, BLOCK_K) // MIN_STEPS_PER_SPLIT
    by_occupancy = cdiv(2 * sms, max(1, num_blocks))
    return max(1, min(MAX_SPLIT_K, by_k, by_occupancy))


@triton.jit
def _shrink_kernel(
    x_ptr,  # [num_tokens, in_features]
    a_ptr,  # [num_slots, rank, in_features]
    shrunk_ptr,  # [split_k, max_rows, BLOCK_R] float32: each K split's partial sums, by sorted position
    sorted_rows_ptr,  # [max_rows] int32 (num_tokens marks padding)
    block_slot_ptr,  # [max_rows / BLOCK_M] int32 (>= NUM_SLOTS: no adapter or past the end)
    num_tokens,
    K,
    R,
    k_per_split,  # a multiple of BLOCK_K
    stride_split,  # max_rows * BLOCK_R
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    NUM_SLOTS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    slot = tl.load(block_slot_ptr + tl.program_id(0))
    if slot >= NUM_SLOTS:
        return
    pos, row, valid = load_block_rows(sorted_rows_ptr, num_tokens, BLOCK_M)
    row = row.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    k_start = tl.program_id(1) * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + row[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=valid[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                    mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]  # fmt: skip
        acc += dot(x, a, PRECISION, UPCAST)
    split_base = shrunk_ptr + tl.program_id(1).to(tl.int64) * stride_split
    tl.store(split_base + pos[:, None] * BLOCK_R + offs_r[None, :], acc)


@triton.jit
def _expand_kernel(
    shrunk_ptr,  # [SPLIT_K, max_rows, BLOCK_R] float32: partial sums, by sorted position
    b_ptr,  # [num_slots, out_features, rank]
    out_ptr,  # [num_tokens, out_features], any strides: updated in place
    sorted_rows_ptr,  # [max_rows] int32 (num_tokens marks padding)
    block_slot_ptr,  # [max_rows / BLOCK_M] int32
    num_tokens,
    N,
    R,
    stride_split,  # max_rows * BLOCK_R
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    NUM_SLOTS: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    slot = tl.load(block_slot_ptr + tl.program_id(0))
    if slot >= NUM_SLOTS:
        return
    pos, row, valid = load_block_rows(sorted_rows_ptr, num_tokens, BLOCK_M)
    row = row.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_h = pos[:, None] * BLOCK_R + offs_r[None, :]
    h = tl.load(shrunk_ptr + offs_h)  # [BLOCK_M, BLOCK_R] float32: the K splits' partial sums added
    for split in tl.static_range(1, SPLIT_K):
        h += tl.load(shrunk_ptr + split * stride_split + offs_h)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                mask=(offs_r[:, None] < R) & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]  # fmt: skip
    delta = dot(h, b.to(tl.float32), PRECISION, UPCAST)  # [BLOCK_M, BLOCK_N]
    offs_out = row[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = valid[:, None] & n_mask[None, :]
    base = tl.load(out_ptr + offs_out, mask=mask, other=0.0)
    tl.store(out_ptr + offs_out, (base.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


def lora_delta(
    x: torch.Tensor,  # [num_tokens, in_features]
    a: torch.Tensor,  # [num_slots, rank, in_features]: each slot's LoRA A
    b: torch.Tensor,  # [num_slots, out_features, rank]: each slot's LoRA B, scaling folded in
    token_slots: torch.Tensor,  # [num_tokens] int32: each row's slot, -1 for none
    out: torch.Tensor,  # [num_tokens, out_features], any strides: updated in place
) -> None:
    """``out[t] += (x[t] @ a[s].T) @ b[s].T`` for each row ``t`` with slot ``s >= 0``
    (see :func:`inflight.kernels.lora_reference.lora_delta`). Never reads ``token_slots`` on
    the host: a slot outside ``[-1, num_slots)``, which the reference refuses, is skipped like
    -1 here (no memory outside the tensors is touched)."""
    check_lora_inputs(x, a, b, token_slots, out)
    num_tokens, in_features = x.shape
    num_slots, rank, _ = a.shape
    out_features = out.shape[1]
    if num_tokens == 0 or num_slots == 0 or rank == 0 or out_features == 0:
        return
    slots = token_slots.long()
    # -1 and out-of-range rows into an extra group ``num_slots``, which no program works on.
    group = torch.where((slots >= 0) & (slots < num_slots), slots, num_slots)[:, None]  # [num_tokens, 1]
    sorted_rows, block_slot = align_pairs(group, num_slots + 1, BLOCK_M)
    block_r = max(16, next_power_of_2(rank))
    max_rows, num_blocks = sorted_rows.shape[0], block_slot.shape[0]
    split_k = plan_split_k(num_blocks, in_features, num_sms(x.device))
    k_per_split = cdiv(cdiv(in_features, BLOCK_K), split_k) * BLOCK_K
    shrunk = torch.empty((split_k, max_rows, block_r), dtype=torch.float32, device=x.device)
    upcast = needs_upcast(x.device)
    _shrink_kernel[(num_blocks, split_k)](
        x, a, shrunk, sorted_rows, block_slot, num_tokens, in_features, rank, k_per_split, max_rows * block_r,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        NUM_SLOTS=num_slots, PRECISION=dot_precision(x.dtype), UPCAST=upcast,
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    _expand_kernel[(num_blocks, cdiv(out_features, BLOCK_N))](
        shrunk, b, out, sorted_rows, block_slot, num_tokens, out_features, rank, max_rows * block_r,
        b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        NUM_SLOTS=num_slots, PRECISION=dot_precision(x.dtype), UPCAST=upcast,
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_N=BLOCK_N, SPLIT_K=split_k,
    )  # fmt: skip
