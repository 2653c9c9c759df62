"""Mamba-2 (the SSD mixer of Granite 4's hybrid layers) over a packed batch: the torch references.

Ops over the packed rows of a step (one-token sequences first, then prompt chunks), each
sequence's state in a pool slot (``slots``; ``has_initial`` False: the sequence's first token is
in this step and it starts from zeros whatever the slot holds, so a slot needs no clearing):

* :func:`causal_conv1d` - the depthwise causal conv over ``kernel`` taps with a bias, SiLU after,
  reading the ``kernel - 1`` inputs before each sequence's first row from ``conv_state`` and
  leaving its last ``kernel - 1`` inputs there.
* :func:`ssd_scan` - the selective state space recurrence, per head ``h`` (B and C shared by the
  ``num_heads / num_groups`` heads of a group) and token: ``S = S * exp(dt * A) + dt * x (x) B;
  y = S C + D x``, from and back to ``state`` (float32, ``[num_slots, heads, head_dim, d_state]``).
  ``dt`` comes in final (softplus of ``dt + dt_bias``, clamped: the layer's job). One-token
  sequences take :func:`state_update` (the one-step decode update, all of them at once); longer
  ones the chunked SSD form (:data:`CHUNK`-token chunks: within a chunk a masked ``C B^T`` product,
  across chunks the state carried), so prefill costs a few matmuls per chunk.

The Triton kernels (:mod:`.triton_mamba2`) and the C decode step (:mod:`.cpu_mamba2`) have these
signatures. These read sequence bounds on the host. Knows nothing about weights or scheduling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inflight.kernels.gated_delta import num_single

CHUNK = 64  # tokens per chunk of the chunked form


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, channels]
    weight: torch.Tensor,  # [channels, kernel]
    bias: torch.Tensor | None,  # [channels]
    conv_state: torch.Tensor,  # [num_slots, channels, kernel - 1], updated in place
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    slots: torch.Tensor,  # [num_seqs] int64
    has_initial: torch.Tensor,  # [num_seqs] bool
) -> torch.Tensor:  # [num_tokens, channels], SiLU applied
    """Depthwise causal conv1d (+ bias, SiLU) of each sequence's rows, continued from its slot."""
    taps = weight.shape[1]
    out = torch.empty_like(x)
    bounds = query_start_loc.tolist()
    ns = num_single(bounds)
    if ns:  # the decode rows, together
        sel = slots[:ns]
        prev = torch.where(has_initial[:ns, None, None], conv_state[sel], 0.0).to(x.dtype)
        window = torch.cat([prev, x[:ns, :, None]], dim=2)  # [n, channels, kernel]
        conv_state[sel] = window[:, :, 1:].to(conv_state.dtype)
        y = (window.to(weight.dtype) * weight).sum(dim=-1)
        out[:ns] = F.silu(y if bias is None else y + bias).to(x.dtype)
    for i, slot in enumerate(slots.tolist()[ns:], start=ns):
        start, end = bounds[i], bounds[i + 1]
        prev = conv_state[slot] if bool(has_initial[i]) else torch.zeros_like(conv_state[slot])
        seq = torch.cat([prev.to(x.dtype), x[start:end].t()], dim=1)  # [channels, kernel - 1 + len]
        conv_state[slot] = seq[:, seq.shape[1] - (taps - 1) :].to(conv_state.dtype)
        y = F.conv1d(seq[None].to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])[0]
        out[start:end] = F.silu(y).t().to(x.dtype)
    return out


def state_update(
    x: torch.Tensor,  # [n, num_heads, head_dim], one token of each of n sequences
    dt: torch.Tensor,  # [n, num_heads] float32, final (softplus'd and clamped)
    A: torch.Tensor,  # [num_heads] float32 (negative)
    B: torch.Tensor,  # [n, num_groups, d_state]
    C: torch.Tensor,  # [n, num_groups, d_state]
    D: torch.Tensor,  # [num_heads]
    state: torch.Tensor,  # [num_slots, num_heads, head_dim, d_state] float32, updated in place
    slots: torch.Tensor,  # [n] int64, distinct
    has_initial: torch.Tensor,  # [n] bool
) -> torch.Tensor:  # [n, num_heads, head_dim] float32
    """The one-step (decode) update of ``n`` one-token sequences."""
    heads = x.shape[1]
    group = heads // B.shape[1]
    xf, dtf = x.float(), dt.float()
    bf = B.float().repeat_interleave(group, dim=1)  # [n, H, N]
    cf = C.float().repeat_interleave(group, dim=1)
    s = torch.where(has_initial[:, None, None, None], state[slots], 0.0)
    decay = torch.exp(dtf * A.float())[..., None, None]  # [n, H, 1, 1]
    s = s * decay + (dtf[..., None] * bf)[:, :, None, :] * xf[..., None]
    state[slots] = s
    return (s @ cf[..., None])[..., 0] + xf * D.float()[:, None]


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
    """The SSD recurrence of each sequence, continued from and saved to its slot's state."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    bounds = query_start_loc.tolist()
    ns = num_single(bounds)
    if ns:
        rows = slice(bounds[0], bounds[ns])
        out[rows] = state_update(x[rows], dt[rows], A, B[rows], C[rows], D, state, slots[:ns], has_initial[:ns])
    group = x.shape[1] // B.shape[1]
    for i in range(ns, len(bounds) - 1):
        start, end, slot = bounds[i], bounds[i + 1], int(slots[i])
        init = state[slot] if bool(has_initial[i]) else torch.zeros_like(state[slot])
        rows = slice(start, end)
        b, c = (t[rows].float().repeat_interleave(group, dim=1) for t in (B, C))
        y, state[slot] = _chunked(x[rows].float(), dt[rows].float(), A.float(), b, c, init)
        out[rows] = y + x[rows].float() * D.float()[:, None]
    return out.to(x.dtype)


def _chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence of ``L`` tokens (x ``[L, H, P]``, dt ``[L, H]``, B/C ``[L, H, N]`` per head,
    state ``[H, P, N]``) in :data:`CHUNK`-token chunks: its outputs ``[L, H, P]`` (no D term) and
    final state."""
    length, heads = x.shape[:2]
    pad = (CHUNK - length % CHUNK) % CHUNK
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).reshape(-1, CHUNK, heads, x.shape[-1])  # [c, T, H, P]
    B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)).reshape(-1, CHUNK, heads, t.shape[-1]) for t in (B, C))  # [c, T, H, N]
    cum = F.pad(dt * A, (0, 0, 0, pad)).reshape(-1, CHUNK, heads).cumsum(dim=1)  # [c, T, H] log decay in chunk
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=x.device).triu(1)
    pair = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(upper[None, :, :, None], float("-inf")).exp()
    scores = torch.einsum("cthn,cshn->ctsh", C, B) * pair  # [c, T, S, H], causal within the chunk
    intra = torch.einsum("ctsh,cshp->cthp", scores, xdt)
    to_end = (cum[:, -1:, :] - cum).exp()  # [c, T, H] decay from each token to its chunk's end
    chunk_states = torch.einsum("cthn,cthp->chpn", B * to_end[..., None], xdt)  # [c, H, P, N]
    out = torch.empty_like(intra)
    for i in range(xdt.shape[0]):
        out[i] = intra[i] + torch.einsum("thn,hpn->thp", C[i], s) * cum[i].exp()[..., None]
        s = s * cum[i, -1].exp()[:, None, None] + chunk_states[i]
    return out.reshape(-1, heads, x.shape[-1])[:length], s
