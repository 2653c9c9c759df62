"""Triton kernels for Mamba-2 (Granite 4's hybrid layers), with :mod:`.mamba2_reference`'s signatures.

* :func:`causal_conv1d`: one program per (sequence, block of channels) walks the sequence's rows,
  each output the ``kernel`` taps over its inputs (the ones before the sequence's first row read
  from the slot's conv state, or zeros for a new sequence) plus the bias, SiLU after; then writes
  the last ``kernel - 1`` inputs back to the slot (column ``j`` of the new state reads old column
  ``j + len``, so writing in column order never clobbers a value still to be read).
* :func:`ssd_scan`: one program per (sequence, head, block of head features) holds its
  ``[BLOCK_P, d_state]`` slice of the SSM state in registers (float32), loaded from the slot
  (zeros for a new sequence). A decode row takes the one-step update ``S = S * exp(dt A) + dt x (x) B;
  y = S C + D x``; a prompt chunk goes ``CHUNK_T`` tokens at a time in the chunked SSD form the torch
  reference uses (within a chunk a causal ``C B^T`` tile weighted by the decays between tokens,
  times ``dt x``, plus ``C`` against the state before the chunk; then the state after it: a few
  ``tl.dot`` tiles). The state goes back to the slot at the end. ``chunked=False`` runs every
  sequence token by token (the plain scan, kept as a second implementation the tests compare).

Launch sizes depend on shapes and the sequence count only. Knows nothing about the model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.triton_common import FLOAT_DTYPES, cdiv, check_dtype, check_ndim, next_power_of_2

BLOCK_C = 64  # conv channels per program
BLOCK_P = 16  # head features per program of the scan
CHUNK_T = 16  # tokens per chunk of the chunked scan (the smallest tl.dot tile)


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


@triton.jit
def _scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr,
    head_dim, d_state, per_group,
    sx_t, sx_h, sdt_t, sb_t, sb_g, sc_t, sc_g, ss0, ss1, ss2, so_t, so_h,
    BP: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    h = tl.program_id(1)
    g = h // per_group
    pp = tl.program_id(2) * BP + tl.arange(0, BP)
    nn = tl.arange(0, BN)
    pmask = pp < head_dim
    nmask = nn < d_state
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    init = tl.load(init_ptr + seq) != 0
    sptr = state_ptr + slot * ss0 + h * ss1 + pp[:, None] * ss2 + nn[None, :]
    smask = pmask[:, None] & nmask[None, :]
    s = tl.load(sptr, mask=smask, other=0.0).to(tl.float32)  # [BP, BN]
    s = tl.where(init, s, 0.0)  # a new sequence: zeros, whatever the slot holds
    a = tl.load(a_ptr + h).to(tl.float32)
    d = tl.load(d_ptr + h).to(tl.float32)
    for i in range(0, end - start):
        t = start.to(tl.int64) + i
        xv = tl.load(x_ptr + t * sx_t + h * sx_h + pp, mask=pmask, other=0.0).to(tl.float32)  # [BP]
        step = tl.load(dt_ptr + t * sdt_t + h).to(tl.float32)
        bv = tl.load(b_ptr + t * sb_t + g * sb_g + nn, mask=nmask, other=0.0).to(tl.float32)  # [BN]
        cv = tl.load(c_ptr + t * sc_t + g * sc_g + nn, mask=nmask, other=0.0).to(tl.float32)
        s = s * tl.exp(step * a) + xv[:, None] * (step * bv)[None, :]
        y = tl.sum(s * cv[None, :], axis=1) + d * xv
        tl.store(out_ptr + t * so_t + h * so_h + pp, y.to(out_ptr.dtype.element_ty), mask=pmask)
    tl.store(sptr, s, mask=smask)


@triton.jit
def _chunk_scan_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr,
    head_dim, d_state, per_group,
    sx_t, sx_h, sdt_t, sb_t, sb_g, sc_t, sc_g, ss0, ss1, ss2, so_t, so_h,
    BP: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """The chunked SSD form: ``BT`` tokens at a time, the chunk's outputs a masked ``C B^T`` tile
    times ``dt x`` plus what the state before it gives, then the state after it (``tl.dot`` tiles)."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    g = h // per_group
    pp = tl.program_id(2) * BP + tl.arange(0, BP)
    nn = tl.arange(0, BN)
    tt = tl.arange(0, BT)
    pmask = pp < head_dim
    nmask = nn < d_state
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    init = tl.load(init_ptr + seq) != 0
    sptr = state_ptr + slot * ss0 + h * ss1 + pp[:, None] * ss2 + nn[None, :]
    smask = pmask[:, None] & nmask[None, :]
    s = tl.load(sptr, mask=smask, other=0.0).to(tl.float32)  # [BP, BN]
    s = tl.where(init, s, 0.0)  # a new sequence: zeros, whatever the slot holds
    a = tl.load(a_ptr + h).to(tl.float32)
    d = tl.load(d_ptr + h).to(tl.float32)
    causal = tt[:, None] >= tt[None, :]
    num_chunked = tl.where(end - start == 1, 0, end - start)
    if end - start == 1:  # a decode row: the one-step update
        t1 = start.to(tl.int64)
        x1 = tl.load(x_ptr + t1 * sx_t + h * sx_h + pp, mask=pmask, other=0.0).to(tl.float32)
        step1 = tl.load(dt_ptr + t1 * sdt_t + h).to(tl.float32)
        b1 = tl.load(b_ptr + t1 * sb_t + g * sb_g + nn, mask=nmask, other=0.0).to(tl.float32)
        c1 = tl.load(c_ptr + t1 * sc_t + g * sc_g + nn, mask=nmask, other=0.0).to(tl.float32)
        s = s * tl.exp(step1 * a) + x1[:, None] * (step1 * b1)[None, :]
        y1 = tl.sum(s * c1[None, :], axis=1) + d * x1
        tl.store(out_ptr + t1 * so_t + h * so_h + pp, y1.to(out_ptr.dtype.element_ty), mask=pmask)
    for c0 in range(0, num_chunked, BT):
        t = start.to(tl.int64) + c0 + tt  # [BT]
        tmask = t < end  # a padded token has dt 0: it neither decays nor adds
        xs = tl.load(x_ptr + t[:, None] * sx_t + h * sx_h + pp[None, :], mask=tmask[:, None] & pmask[None, :],
                     other=0.0).to(tl.float32)  # [BT, BP]
        step = tl.load(dt_ptr + t * sdt_t + h, mask=tmask, other=0.0).to(tl.float32)  # [BT]
        bs = tl.load(b_ptr + t[:, None] * sb_t + g * sb_g + nn[None, :], mask=tmask[:, None] & nmask[None, :],
                     other=0.0).to(tl.float32)  # [BT, BN]
        cs = tl.load(c_ptr + t[:, None] * sc_t + g * sc_g + nn[None, :], mask=tmask[:, None] & nmask[None, :],
                     other=0.0).to(tl.float32)
        cum = tl.cumsum(step * a, axis=0)  # [BT] log decay from the chunk's start
        total = tl.sum(step * a, axis=0)
        xdt = xs * step[:, None]
        scores = tl.dot(cs, tl.trans(bs), input_precision="ieee")  # [BT, BT]
        scores = scores * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        y = tl.dot(scores, xdt, input_precision="ieee")
        y += tl.dot(cs, tl.trans(s), input_precision="ieee") * tl.exp(cum)[:, None] + d * xs
        tl.store(out_ptr + t[:, None] * so_t + h * so_h + pp[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & pmask[None, :])  # fmt: skip
        to_end = xdt * tl.exp(total - cum)[:, None]  # [BT, BP]
        s = s * tl.exp(total) + tl.dot(tl.trans(to_end), bs, input_precision="ieee")
    tl.store(sptr, s, mask=smask)


def ssd_scan(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    dt: torch.Tensor,  # [num_tokens, num_heads] float32, final
    A: torch.Tensor,  # [num_heads] float32
    B: torch.Tensor,  # [num_tokens, num_groups, d_state]
    C: torch.Tensor,  # [num_tokens, num_groups, d_state]
    D: torch.Tensor,  # [num_heads]
    state: torch.Tensor,  # [num_slots, num_heads, head_dim, d_state] float32, updated in place
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    slots: torch.Tensor,  # [num_seqs] int64
    has_initial: torch.Tensor,  # [num_seqs] bool
    chunked: bool = True,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] in x's dtype
    """See :func:`inflight.kernels.mamba2_reference.ssd_scan`. ``chunked``: the chunked kernel for
    prompt chunks (else the token-by-token scan, for the tests)."""
    check_ndim("x", x, 3, "[num_tokens, num_heads, head_dim]")
    check_ndim("state", state, 4, "[num_slots, num_heads, head_dim, d_state]")
    check_dtype("x", x, FLOAT_DTYPES)
    _, heads, head_dim = x.shape
    groups, d_state = B.shape[1:]
    if state.shape[1:] != (heads, head_dim, d_state) or state.dtype != torch.float32 or state.stride(3) != 1:
        raise ValueError(f"state {tuple(state.shape)} must be float32 [num_slots, {heads}, {head_dim}, {d_state}] "
                         "(last dim dense).")  # fmt: skip
    if heads % groups:
        raise ValueError(f"{heads} heads do not split into {groups} groups.")
    x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    out = torch.empty_like(x)
    num_seqs = slots.shape[0]
    if num_seqs == 0:
        return out
    grid = (num_seqs, heads, cdiv(head_dim, BLOCK_P))
    args = (
        x, dt, A.float().contiguous(), B, C, D.float().contiguous(), state, out, query_start_loc, slots,
        has_initial.to(torch.int32), head_dim, d_state, heads // groups,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
    )  # fmt: skip
    block_n = max(16, next_power_of_2(d_state))  # tl.dot tiles are at least 16 wide
    if chunked:
        _chunk_scan_kernel[grid](*args, BP=BLOCK_P, BN=block_n, BT=CHUNK_T)
    else:
        _scan_kernel[grid](*args, BP=BLOCK_P, BN=block_n)
    return out
