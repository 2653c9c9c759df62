"""Qwen3-Next's linear-attention layer (Gated DeltaNet) over a packed batch with per-sequence state.

Each running sequence holds a slot of the state pool (:mod:`inflight.runtime.core.state_pool`):
per linear layer a conv state ``[conv_dim, conv_kernel - 1]`` (the last inputs of the causal
conv) and a recurrent state ``[num_v_heads, k_head_dim, v_head_dim]`` (float32). The runner
allocates the two pool tensors per layer (:func:`state_shapes`) and hands them to the layer in
the place an attention layer gets its KV cache; :class:`StateRows` says, per sequence of the
step, which slot it reads and writes and whether it starts from zeros (its first token is in
this step) or from the slot (decode, or a later prompt chunk: chunked prefill carries the state).
A step with speculating chunks (a sequence's last token plus its drafts, packed as decode rows)
runs its decode rows position by position through the one-token kernels (:func:`run_state_op`):
after each position the state of every chunk that goes on is copied to a scratch slot of the
pool, so the runner can give each slot the state after its last accepted token once the drafts
are verified (:mod:`inflight.runtime.worker.hybrid_cache`).

The layer: ``in_proj_qkvz`` and ``in_proj_ba`` (grouped per key head in the checkpoint, as
transformers' ``fix_query_key_value_ordering`` reads them), the causal conv over q/k/v with SiLU,
``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, the gated delta rule, an
RMSNorm of each head's output gated by ``silu(z)`` (weight as stored: not zero-centred), then
``out_proj``. The conv and the rule run through :func:`kernels_for` (Triton for the triton
kernel bundle; the native CPU bundle's decode rows in C; else the torch references of
:mod:`inflight.kernels.gated_delta`). Knows
nothing about scheduling; unsharded only (tensor parallelism is refused at load).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inflight.kernels import gated_delta
from inflight.kernels.ops import KernelOps
from inflight.runtime.model.batch import AttentionMetadata, StateSteps
from inflight.runtime.model.spec_types import GatedDeltaSpec


@dataclass(frozen=True, slots=True)
class PositionStep:
    """The decode rows at one position of their chunk (position 0: every one-token row and each
    speculating chunk's first), run as one-token sequences, and the states kept after them."""

    rows: torch.Tensor  # [n] int64, rows of the packed batch
    query_start_loc: torch.Tensor  # [n + 1] int32, 0..n (each a one-token sequence)
    slots: torch.Tensor  # [n] int64, distinct
    has_initial: torch.Tensor  # [n] bool
    keep_from: torch.Tensor  # [m] int64, slots of the speculating chunks that go on past this position
    keep_to: torch.Tensor  # [m] int64, the scratch slots that keep their state after it


@dataclass(frozen=True, slots=True)
class StateRows:
    """The step's sequences as the linear layers read them (decode rows first, as packed)."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, row offsets over the whole packed batch
    slots: torch.Tensor  # [num_seqs] int64, each sequence's state-pool slot
    has_initial: torch.Tensor  # [num_seqs] bool: continue from the slot (else start from zeros)
    num_decode_tokens: int = 0
    # speculating chunks in the step: the decode rows position by position (meta.state_steps); else None
    steps: tuple[PositionStep, ...] | None = None

    @classmethod
    def of(cls, meta: AttentionMetadata) -> StateRows:
        """From the step's metadata; ``meta.state_slots`` must be set (a hybrid model's step)."""
        if meta.state_slots is None:
            raise RuntimeError("a hybrid model's step needs meta.state_slots (each sequence's state-pool slot)")
        nd = meta.num_decode_tokens
        device = meta.slot_mapping.device
        decode_starts = torch.arange(nd, dtype=torch.int32, device=device)
        prefill_starts = meta.prefill_query_start_loc[: meta.num_prefills + 1].to(torch.int32) + nd
        if meta.num_prefills == 0:
            prefill_starts = torch.full((1,), nd, dtype=torch.int32, device=device)
        starts = torch.cat([decode_starts, prefill_starts])
        lens = starts[1:] - starts[:-1]
        context = torch.cat([meta.decode_context_lens[:nd], meta.prefill_context_lens[: meta.num_prefills]])
        steps = None if meta.state_steps is None else position_steps(meta.state_steps)
        return cls(starts, meta.state_slots.to(torch.int64), context.to(torch.int32) > lens, nd, steps)


def position_steps(plan: StateSteps) -> tuple[PositionStep, ...]:
    """``plan``'s decode rows cut into one :class:`PositionStep` a position (bounds read on the host)."""
    rb, kb = plan.row_bounds.tolist(), plan.keep_bounds.tolist()
    device = plan.rows.device
    return tuple(PositionStep(plan.rows[r0:r1], torch.arange(r1 - r0 + 1, dtype=torch.int32, device=device),
                              plan.slots[r0:r1], plan.has_initial[r0:r1], plan.keep_from[k0:k1], plan.keep_to[k0:k1])
                 for r0, r1, k0, k1 in zip(rb, rb[1:], kb, kb[1:], strict=False))  # fmt: skip


StateOp = Callable[[torch.Tensor | slice, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def run_state_op(op: StateOp, rows: StateRows, state: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``op(select, query_start_loc, slots, has_initial)`` (a conv or recurrence over the packed
    rows ``select``, updating ``state`` in place) over the step: in one call; or, with speculating
    chunks in the step, the decode rows position by position (one-token calls), each position's
    states kept in their scratch slots, then the prompt chunks in one call."""
    if rows.steps is None:
        return op(slice(None), rows.query_start_loc, rows.slots, rows.has_initial)
    parts: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
    for step in rows.steps:
        parts.append((step.rows, op(step.rows, step.query_start_loc, step.slots, step.has_initial)))
        if step.keep_to.numel():
            state[step.keep_to] = state[step.keep_from]
    nd = rows.num_decode_tokens
    if num_tokens > nd:  # the prompt chunks, as one call (offsets relative to their first row)
        prompts = slice(nd, None)
        parts.append((prompts, op(prompts, rows.query_start_loc[nd:] - nd, rows.slots[nd:], rows.has_initial[nd:])))
    first = parts[0][1]
    out = first.new_empty((num_tokens, *first.shape[1:]))
    for select, part in parts:
        out[select] = part
    return out


def state_shapes(spec: GatedDeltaSpec, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one linear layer's conv-state and recurrent-state pool tensors."""
    return ((num_slots, spec.conv_dim, spec.conv_kernel - 1),
            (num_slots, spec.num_v_heads, spec.k_head_dim, spec.v_head_dim))  # fmt: skip


ConvFn = Callable[..., torch.Tensor]


def kernels_for(ops: KernelOps) -> tuple[ConvFn, ConvFn]:
    """(causal_conv1d, gated_delta_rule) for the bundle: Triton's for the Triton bundle; on the
    native CPU bundle the rule's decode rows in C (:mod:`inflight.kernels.cpu_gated_delta`); else
    the torch references."""
    if ops.name.startswith("triton"):
        from inflight.kernels import triton_gated_delta

        return triton_gated_delta.causal_conv1d, triton_gated_delta.gated_delta_rule
    if ops.name.startswith("cpu-native"):
        from inflight.kernels import cpu_gated_delta

        return gated_delta.causal_conv1d, cpu_gated_delta.gated_delta_rule
    return gated_delta.causal_conv1d, gated_delta.gated_delta_rule


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (weight as stored), times ``silu(gate)``, in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (checkpoint name ``linear_attn``)."""

    def __init__(self, hidden_size: int, spec: GatedDeltaSpec, eps: float) -> None:
        super().__init__()
        self.spec = spec
        hk, hv, dk, dv = spec.num_k_heads, spec.num_v_heads, spec.k_head_dim, spec.v_head_dim
        if hv % hk:
            raise ValueError(f"linear_num_value_heads {hv} must be a multiple of linear_num_key_heads {hk}.")
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * hk * dk + 2 * hv * dv, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * hv, bias=False)
        self.conv1d = nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.conv_kernel, groups=spec.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(dv, eps)
        self.out_proj = nn.Linear(hv * dv, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], rows: StateRows,
                ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """``x`` ``[num_tokens, hidden]``; ``state``: this layer's (conv, recurrent) pool tensors."""
        spec = self.spec
        hk, hv, dk, dv = spec.num_k_heads, spec.num_v_heads, spec.k_head_dim, spec.v_head_dim
        n, per = x.shape[0], hv // hk
        qkvz = ops.linear(x, self.in_proj_qkvz.weight).view(n, hk, 2 * dk + 2 * per * dv)
        ba = ops.linear(x, self.in_proj_ba.weight).view(n, hk, 2 * per)
        q, k, v, z = qkvz.split([dk, dk, per * dv, per * dv], dim=-1)
        b, a = ba.split([per, per], dim=-1)
        inputs = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)  # [n, conv_dim]
        conv_fn, rule_fn = kernels_for(ops)
        conv_state, rec_state = state
        weight = self.conv1d.weight[:, 0, :]
        mixed = run_state_op(lambda sel, starts, slots, init: conv_fn(inputs[sel], weight, conv_state, starts, slots,
                                                                      init), rows, conv_state, n)  # fmt: skip
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        beta = b.reshape(n, hv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(n, hv).float() + self.dt_bias)
        q, k, v = q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv)
        out = run_state_op(lambda sel, starts, slots, init: rule_fn(q[sel], k[sel], v[sel], g[sel], beta[sel],
                                                                    rec_state, starts, slots, init),
                           rows, rec_state, n)  # fmt: skip
        out = self.norm(out.reshape(n * hv, dv), z.reshape(n * hv, dv)).reshape(n, hv * dv)
        return ops.linear(out, self.out_proj.weight)
