"""The causal depthwise conv1d of linear-attention and Mamba-2 layers in Triton, with
:func:`inflight.kernels.mamba2_reference.causal_conv1d`'s signature (Gated DeltaNet's,
:func:`inflight.kernels.gated_delta.causal_conv1d`, is the same without the bias).

One program per (sequence, block of channels) walks the sequence's rows, each output the ``kernel``
taps over its inputs (the ones before the sequence's first row read from the slot's conv state, or
zeros for a new sequence) plus the bias if any, SiLU after; then writes the last ``kernel - 1``
inputs back to the slot (column ``j`` of the new state reads old column ``j + len``, so writing in
column order never clobbers a value still to be read). Launch sizes depend on shapes and the
sequence count only. Knows nothing about the model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.triton_common import FLOAT_DTYPES, cdiv, check_dtype, check_ndim

BLOCK_C = 64  # conv channels per program


@triton.jit
def _conv_kernel(
    x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr,
    channels, sx, sw, ss0, ss1, so,
    TAPS: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = c < channels
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    init = tl.load(init_ptr + seq) != 0
    state = state_ptr + slot * ss0 + c.to(tl.int64) * ss1
    bias = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    for i in range(0, end - start):
        t = start.to(tl.int64) + i
        acc = bias
        for j in tl.static_range(TAPS):
            p = t - (TAPS - 1) + j + c * 0  # [BLOCK], one position (masks need block shapes)
            xv = tl.load(x_ptr + p * sx + c, mask=cmask & (p >= start), other=0.0).to(tl.float32)
            sv = tl.load(state + (TAPS - 1 + p - start), mask=cmask & (p < start), other=0.0).to(tl.float32)
            sv = tl.where(init, sv, 0.0)
            w = tl.load(w_ptr + c * sw + j, mask=cmask, other=0.0).to(tl.float32)
            acc += w * (xv + sv)
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + t * so + c, y.to(out_ptr.dtype.element_ty), mask=cmask)
    for j in tl.static_range(TAPS - 1):
        p = end.to(tl.int64) - (TAPS - 1) + j + c * 0
        xv = tl.load(x_ptr + p * sx + c, mask=cmask & (p >= start), other=0.0).to(tl.float32)
        sv = tl.load(state + (TAPS - 1 + p - start), mask=cmask & (p < start), other=0.0).to(tl.float32)
        sv = tl.where(init, sv, 0.0)
        tl.store(state + j, (xv + sv).to(state_ptr.dtype.element_ty), mask=cmask)


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, channels]
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None,  # [channels]
    conv_state: torch.Tensor,  # [num_slots, channels, kernel - 1], updated in place
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    slots: torch.Tensor,  # [num_seqs] int64
    has_initial: torch.Tensor,  # [num_seqs] bool
) -> torch.Tensor:  # [num_tokens, channels]
    """See :func:`inflight.kernels.mamba2_reference.causal_conv1d`."""
    check_ndim("x", x, 2, "[num_tokens, channels]")
    check_ndim("conv_state", conv_state, 3, "[num_slots, channels, kernel - 1]")
    check_dtype("x", x, FLOAT_DTYPES)
    channels, taps = weight.shape
    if conv_state.shape[1:] != (channels, taps - 1) or x.shape[1] != channels or conv_state.stride(2) != 1:
        raise ValueError(f"conv_state {tuple(conv_state.shape)} must be [num_slots, {channels}, {taps - 1}] (last "
                         f"dim dense) for x {tuple(x.shape)} and weight {tuple(weight.shape)}.")  # fmt: skip
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    num_seqs = slots.shape[0]
    if num_seqs == 0:
        return out
    grid = (num_seqs, cdiv(channels, BLOCK_C))
    _conv_kernel[grid](
        x, weight, weight if bias is None else bias.contiguous(), conv_state, out, query_start_loc, slots,
        has_initial.to(torch.int32), channels, x.stride(0), weight.stride(0), conv_state.stride(0),
        conv_state.stride(1), out.stride(0), TAPS=taps, BLOCK=BLOCK_C, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return out
