"""Triton kernels for Gated DeltaNet (Qwen3-Next's linear attention), with :mod:`.gated_delta`'s signatures.

* :func:`causal_conv1d`: the shared conv kernel (:mod:`.triton_causal_conv`), without a bias.
* :func:`gated_delta_rule`: one program per (sequence, value head, block of value features) holds
  its ``[k_head_dim, BLOCK_V]`` slice of the recurrent state in registers (float32), loaded from
  the slot (zeros for a new sequence), q/k L2-normalised in the kernel. A one-token sequence (a
  decode row) takes the one-step update ``S *= exp(g); S += k (x) beta (v - S^T k); o = S^T q``; a
  prompt chunk goes ``CHUNK_T`` tokens at a time in the chunked form the torch reference uses
  (within a chunk the updates are one unit-triangular system, inverted by forward substitution in
  registers; then a few ``tl.dot`` tiles give the chunk's outputs and the state after it). The
  state goes back to the slot at the end.

Launch sizes depend on shapes and the sequence count only. Knows nothing about the model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.triton_causal_conv import causal_conv1d as conv_with_bias
from inflight.kernels.triton_common import cdiv, check_dtype, check_ndim, next_power_of_2

BLOCK_V = 32  # value features per program of the rule
CHUNK_T = 16  # tokens per chunk of the chunked rule (the smallest tl.dot tile)


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, channels]
    weight: torch.Tensor,  # [channels, kernel]
    conv_state: torch.Tensor,  # [num_slots, channels, kernel - 1], updated in place
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    slots: torch.Tensor,  # [num_seqs] int64
    has_initial: torch.Tensor,  # [num_seqs] bool
) -> torch.Tensor:  # [num_tokens, channels]
    """See :func:`inflight.kernels.gated_delta.causal_conv1d` (the shared kernel, no bias)."""
    return conv_with_bias(x, weight, None, conv_state, query_start_loc, slots, has_initial)


@triton.jit
def _chunk_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, state_ptr, out_ptr, qsl_ptr, slots_ptr, init_ptr,
    dk, dv, group, qk_scale,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, ss0, ss1, ss2, so_t, so_h,
    BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """The chunked form: ``BT`` tokens at a time, their delta-rule updates one unit-triangular
    system solved by forward substitution in registers (the torch reference's algorithm)."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    tt = tl.arange(0, BT)
    kmask = kk < dk
    vmask = vv < dv
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    init = tl.load(init_ptr + seq) != 0
    sptr = state_ptr + slot * ss0 + h * ss1 + kk[:, None] * ss2 + vv[None, :]
    smask = kmask[:, None] & vmask[None, :]
    s = tl.load(sptr, mask=smask, other=0.0).to(tl.float32)  # [BK, BV]
    s = tl.where(init, s, 0.0)  # a new sequence: zeros, whatever the slot holds
    lower = tt[:, None] > tt[None, :]  # strictly lower
    eye = (tt[:, None] == tt[None, :]).to(tl.float32)
    # a one-token sequence (a decode row): the one-step update, no system to solve
    num_chunked = tl.where(end - start == 1, 0, end - start)
    if end - start == 1:
        t64 = start.to(tl.int64)
        q1 = tl.load(q_ptr + t64 * sq_t + hk * sq_h + kk, mask=kmask, other=0.0).to(tl.float32)
        k1 = tl.load(k_ptr + t64 * sk_t + hk * sk_h + kk, mask=kmask, other=0.0).to(tl.float32)
        q1 = q1 * (1.0 / tl.sqrt(tl.sum(q1 * q1, axis=0) + 1e-6)) * qk_scale
        k1 = k1 * (1.0 / tl.sqrt(tl.sum(k1 * k1, axis=0) + 1e-6))
        v1 = tl.load(v_ptr + t64 * sv_t + h * sv_h + vv, mask=vmask, other=0.0).to(tl.float32)
        s = s * tl.exp(tl.load(g_ptr + t64 * sg_t + h).to(tl.float32))
        delta = (v1 - tl.sum(s * k1[:, None], axis=0)) * tl.load(b_ptr + t64 * sb_t + h).to(tl.float32)
        s = s + k1[:, None] * delta[None, :]
        o1 = tl.sum(s * q1[:, None], axis=0)
        tl.store(out_ptr + t64 * so_t + h * so_h + vv, o1.to(out_ptr.dtype.element_ty), mask=vmask)
    for c0 in range(0, num_chunked, BT):
        t = start.to(tl.int64) + c0 + tt  # [BT]
        tmask = t < end
        q = tl.load(q_ptr + t[:, None] * sq_t + hk * sq_h + kk[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)  # [BT, BK]
        k = tl.load(k_ptr + t[:, None] * sk_t + hk * sk_h + kk[None, :], mask=tmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t[:, None] * sv_t + h * sv_h + vv[None, :], mask=tmask[:, None] & vmask[None, :],
                    other=0.0).to(tl.float32)  # [BT, BV]
        g = tl.load(g_ptr + t * sg_t + h, mask=tmask, other=0.0).to(tl.float32)  # [BT]
        beta = tl.load(b_ptr + t * sb_t + h, mask=tmask, other=0.0).to(tl.float32)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=1) + 1e-6))[:, None] * qk_scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=1) + 1e-6))[:, None]
        cum = tl.cumsum(g, axis=0)  # [BT] log decay from the chunk's start
        total = tl.sum(g, axis=0)
        diff = cum[:, None] - cum[None, :]
        k_beta = k * beta[:, None]
        a = tl.dot(k_beta, tl.trans(k), input_precision="ieee") * tl.exp(tl.where(lower, diff, float("-inf")))
        inv = eye  # (I + a)^-1, row by row: row i = e_i - a[i, :] @ inv (rows above i final)
        for i in tl.static_range(1, BT):
            a_i = tl.sum(tl.where(tt[:, None] == i, a, 0.0), axis=0)  # [BT] row i of a
            row = tl.sum(a_i[:, None] * inv, axis=0)
            inv = tl.where(tt[:, None] == i, inv - row[None, :], inv)
        u = tl.dot(inv, v * beta[:, None], input_precision="ieee")  # [BT, BV]
        w = tl.dot(inv, k_beta * tl.exp(cum)[:, None], input_precision="ieee")  # [BT, BK]
        intra = tl.dot(q, tl.trans(k), input_precision="ieee")
        intra = intra * tl.exp(tl.where(lower | (eye > 0), diff, float("-inf")))
        v_new = u - tl.dot(w, s, input_precision="ieee")
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision="ieee") + tl.dot(intra, v_new, input_precision="ieee")
        tl.store(out_ptr + t[:, None] * so_t + h * so_h + vv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None] & vmask[None, :])  # fmt: skip
        k_end = k * tl.exp(total - cum)[:, None]
        s = s * tl.exp(total) + tl.dot(tl.trans(k_end), v_new, input_precision="ieee")
    tl.store(sptr, s, mask=smask)


def gated_delta_rule(
    q: torch.Tensor,  # [num_tokens, num_k_heads, k_head_dim]
    k: torch.Tensor,  # [num_tokens, num_k_heads, k_head_dim]
    v: torch.Tensor,  # [num_tokens, num_v_heads, v_head_dim]
    g: torch.Tensor,  # [num_tokens, num_v_heads] float32
    beta: torch.Tensor,  # [num_tokens, num_v_heads]
    state: torch.Tensor,  # [num_slots, num_v_heads, k_head_dim, v_head_dim] float32, updated in place
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    slots: torch.Tensor,  # [num_seqs] int64
    has_initial: torch.Tensor,  # [num_seqs] bool
) -> torch.Tensor:  # [num_tokens, num_v_heads, v_head_dim]
    """See :func:`inflight.kernels.gated_delta.gated_delta_rule`."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_ndim(name, t, 3, "[num_tokens, heads, head_dim]")
    check_dtype("state", state, (torch.float32,))
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads, dv = v.shape[1:]
    if q.shape != k.shape or num_v_heads % num_k_heads or state.shape[1:] != (num_v_heads, dk, dv):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and state "
                         f"{tuple(state.shape)} do not fit together.")  # fmt: skip
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    g, beta = g.contiguous(), beta.contiguous()
    if state.stride(3) != 1:
        raise ValueError("state's last dimension must be dense.")
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    num_seqs = slots.shape[0]
    if num_seqs == 0:
        return out
    block_v = max(16, min(BLOCK_V, next_power_of_2(dv)))
    grid = (num_seqs, num_v_heads, cdiv(dv, block_v))
    args = (
        q, k, v, g, beta, state, out, query_start_loc, slots, has_initial.to(torch.int32),
        dk, dv, num_v_heads // num_k_heads, dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
    )  # fmt: skip
    _chunk_rule_kernel[grid](*args, BK=max(16, next_power_of_2(dk)), BV=block_v, BT=CHUNK_T)
    return out
