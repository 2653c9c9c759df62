"""Gated DeltaNet (Qwen3-Next's linear attention) over a packed batch: the torch references.

Two ops, each over the packed rows of a step (one-token sequences first, then prompt chunks),
with every sequence's recurrent state held in a pool slot (``slots``: the sequence's slot;
``has_initial``: False for a sequence whose first token is in this step, which then starts
from zeros whatever the slot holds, so a slot needs no clearing when it is handed out again):

* :func:`causal_conv1d` - the depthwise causal convolution over ``kernel`` taps (SiLU after),
  reading the ``kernel - 1`` inputs before each sequence's first row from ``conv_state`` and
  leaving its last ``kernel - 1`` inputs there.
* :func:`gated_delta_rule` - q/k L2-normalised, q scaled by ``1/sqrt(k_head_dim)``, then per
  token ``S = S * exp(g); S += k (x) beta * (v - S^T k); o = S^T q`` per value head (a query/key
  head serves ``num_v_heads / num_k_heads`` consecutive value heads), from and back to ``state``
  (float32). A one-token sequence takes the recurrent step (as transformers' decode does); a
  longer one the chunked form (transformers' ``torch_chunk_gated_delta_rule``, 64-token chunks
  solved with a unit-triangular system), so prefill costs a few matmuls per chunk.

The Triton kernels (:mod:`.triton_gated_delta`) have the same signatures. These read the
sequence bounds on the host (a loop over prompt chunks, vectorised over decode rows). Knows
nothing about the model's weights or scheduling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunked form (transformers' default)


def causal_conv1d(
    x: torch.Tensor,  # [num_tokens, channels]
    weight: torch.Tensor,  # [channels, kernel]
    conv_state: torch.Tensor,  # [num_slots, channels, kernel - 1], updated in place
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, row offsets of each sequence
    slots: torch.Tensor,  # [num_seqs] int64
    has_initial: torch.Tensor,  # [num_seqs] bool
) -> torch.Tensor:  # [num_tokens, channels], SiLU applied
    """Depthwise causal conv1d of each sequence's rows, continued from its slot's last inputs
    (the leading one-token sequences, decode rows, together)."""
    taps = weight.shape[1]
    out = torch.empty_like(x)
    bounds = query_start_loc.tolist()
    ns = num_single(bounds)
    if ns:
        sel = slots[:ns]
        prev = torch.where(has_initial[:ns, None, None], conv_state[sel], 0.0).to(x.dtype)
        window = torch.cat([prev, x[:ns, :, None]], dim=2)  # [n, channels, kernel]
        conv_state[sel] = window[:, :, 1:].to(conv_state.dtype)
        y = (window.to(weight.dtype) * weight).sum(dim=-1)
        out[:ns] = F.silu(y).to(x.dtype)
    for i, slot in enumerate(slots.tolist()[ns:], start=ns):
        start, end = bounds[i], bounds[i + 1]
        prev = conv_state[slot] if bool(has_initial[i]) else torch.zeros_like(conv_state[slot])
        seq = torch.cat([prev.to(x.dtype), x[start:end].t()], dim=1)  # [channels, kernel - 1 + len]
        conv_state[slot] = seq[:, seq.shape[1] - (taps - 1) :].to(conv_state.dtype)
        y = F.conv1d(seq[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
        out[start:end] = F.silu(y).t().to(x.dtype)
    return out


def num_single(bounds: list[int]) -> int:
    """How many leading sequences of the packed batch are one token long (its decode rows)."""
    return next((i for i in range(len(bounds) - 1) if bounds[i + 1] - bounds[i] != 1), len(bounds) - 1)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dimension (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gated_delta_rule(
    q: torch.Tensor,  # [num_tokens, num_k_heads, k_head_dim]
    k: torch.Tensor,  # [num_tokens, num_k_heads, k_head_dim]
    v: torch.Tensor,  # [num_tokens, num_v_heads, v_head_dim]
    g: torch.Tensor,  # [num_tokens, num_v_heads] float32, log of the decay (<= 0)
    beta: torch.Tensor,  # [num_tokens, num_v_heads]
    state: torch.Tensor,  # [num_slots, num_v_heads, k_head_dim, v_head_dim] float32, updated in place
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    slots: torch.Tensor,  # [num_seqs] int64
    has_initial: torch.Tensor,  # [num_seqs] bool
) -> torch.Tensor:  # [num_tokens, num_v_heads, v_head_dim] in v's dtype
    """The gated delta rule of each sequence, continued from and saved to its slot's state."""
    group = v.shape[1] // k.shape[1]
    qf = l2norm(q.float()).repeat_interleave(group, dim=1) * q.shape[-1] ** -0.5
    kf = l2norm(k.float()).repeat_interleave(group, dim=1)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = query_start_loc.tolist()
    ns = num_single(bounds)
    if ns:  # the one-token sequences (decode rows), together
        rows = slice(bounds[0], bounds[ns])
        sel = slots[:ns]
        init = torch.where(has_initial[:ns, None, None, None], state[sel], 0.0)
        o, new = _recurrent_step(qf[rows], kf[rows], vf[rows], gf[rows], bf[rows], init)
        out[rows] = o
        state[sel] = new
    for i in range(ns, len(bounds) - 1):
        start, end, slot = bounds[i], bounds[i + 1], int(slots[i])
        init = state[slot] if bool(has_initial[i]) else torch.zeros_like(state[slot])
        rows = slice(start, end)
        if end - start == 1:
            o, new = _recurrent_step(qf[rows], kf[rows], vf[rows], gf[rows], bf[rows], init[None])
            out[rows], state[slot] = o, new[0]
        else:
            out[rows], state[slot] = _chunked(qf[rows], kf[rows], vf[rows], gf[rows], bf[rows], init)
    return out.to(v.dtype)


def _recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One token of each of ``n`` sequences: q/k ``[n, H, dk]``, v ``[n, H, dv]``, g/beta ``[n, H]``,
    state ``[n, H, dk, dv]``; the outputs ``[n, H, dv]`` and the new states."""
    s = s * g.exp()[..., None, None]
    kv_mem = (s * k[..., None]).sum(dim=-2)  # [n, H, dv]
    delta = (v - kv_mem) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(dim=-2), s


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence of ``L`` tokens in 64-token chunks (q/k ``[L, H, dk]`` normalised and scaled,
    v ``[L, H, dv]``, g/beta ``[L, H]``, state ``[H, dk, dv]``): its outputs ``[L, H, dv]`` and
    final state. Within a chunk the delta-rule updates are one unit-triangular solve."""
    length = q.shape[0]
    pad = (CHUNK - length % CHUNK) % CHUNK
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, L + pad, d]
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))  # [H, L + pad]
    heads = q.shape[0]
    q, k, v = (x.reshape(heads, -1, CHUNK, x.shape[-1]) for x in (q, k, v))  # [H, C, CHUNK, d]
    k_beta = k * beta.reshape(heads, -1, CHUNK, 1)
    v_beta = v * beta.reshape(heads, -1, CHUNK, 1)
    cum = g.reshape(heads, -1, CHUNK).cumsum(dim=-1)  # [H, C, CHUNK] log decay from the chunk's start
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair  # [H, C, CHUNK, CHUNK], unit lower-triangular after +I
    intra = (q @ k.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, C, 1, 1]
    out = torch.empty_like(new_v)
    for c in range(q.shape[1]):
        v_new = new_v[:, c] - k_cum[:, c] @ s
        out[:, c] = q[:, c] @ s + intra[:, c] @ v_new
        s = s * chunk_decay[:, c] + k[:, c].transpose(-1, -2) @ v_new
    out = out.reshape(heads, -1, out.shape[-1])[:, :length]
    return out.transpose(0, 1), s
