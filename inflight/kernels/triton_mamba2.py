"""Triton kernels for Mamba-2 (Granite 4's hybrid layers), with :mod:`.mamba2_reference`'s signatures.

* :func:`causal_conv1d`: the shared conv kernel (:mod:`.triton_causal_conv`), with the bias.
* :func:`ssd_scan`: one program per (sequence, head, block of head features) holds its
  ``[BLOCK_P, d_state]`` slice of the SSM state in registers (float32), loaded from the slot
  (zeros for a new sequence). A decode row takes the one-step update ``S = S * exp(dt A) + dt x (x) B;
  y = S C + D x``; a prompt chunk goes ``CHUNK_T`` tokens at a time in the chunked SSD form the torch
  reference uses (within a chunk a causal ``C B^T`` tile weighted by the decays between tokens,
  times ``dt x``, plus ``C`` against the state before the chunk; then the state after it: a few
  ``tl.dot`` tiles). The state goes back to the slot at the end.

Launch sizes depend on shapes and the sequence count only. Knows nothing about the model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.triton_causal_conv import causal_conv1d
from inflight.kernels.triton_common import FLOAT_DTYPES, cdiv, check_dtype, check_ndim, next_power_of_2

__all__ = ["causal_conv1d", "ssd_scan"]

BLOCK_P = 16  # head features per program of the scan
CHUNK_T = 16  # tokens per chunk of the chunked scan (the smallest tl.dot tile)


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
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] in x's dtype
    """See :func:`inflight.kernels.mamba2_reference.ssd_scan`."""
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
    _chunk_scan_kernel[grid](*args, BP=BLOCK_P, BN=block_n, BT=CHUNK_T)
    return out
