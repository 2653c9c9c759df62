"""Qwen3-Next's linear-attention layer (Gated DeltaNet) over a packed batch with per-sequence state.

Each running sequence holds a slot of the state pool (:mod:`inflight.runtime.core.state_pool`):
per linear layer a conv state ``[conv_dim, conv_kernel - 1]`` (the last inputs of the causal
conv) and a recurrent state ``[num_v_heads, k_head_dim, v_head_dim]`` (float32). The runner
allocates the two pool tensors per layer (:func:`state_shapes`) and hands them to the layer in
the place an attention layer gets its KV cache; :class:`StateRows` says, per sequence of the
step, which slot it reads and writes and whether it starts from zeros (its first token is in
this step) or from the slot (decode, or a later prompt chunk: chunked prefill carries the state).

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
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.spec_types import GatedDeltaSpec


@dataclass(frozen=True, slots=True)
class StateRows:
    """The step's sequences as the linear layers read them (decode rows first, as packed)."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, row offsets over the whole packed batch
    slots: torch.Tensor  # [num_seqs] int64, each sequence's state-pool slot
    has_initial: torch.Tensor  # [num_seqs] bool: continue from the slot (else start from zeros)

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
        return cls(starts, meta.state_slots.to(torch.int64), context.to(torch.int32) > lens)


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
        mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)  # [n, conv_dim]
        conv_fn, rule_fn = kernels_for(ops)
        conv_state, rec_state = state
        mixed = conv_fn(mixed, self.conv1d.weight[:, 0, :], conv_state, rows.query_start_loc, rows.slots,
                        rows.has_initial)  # fmt: skip
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        beta = b.reshape(n, hv).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(n, hv).float() + self.dt_bias)
        out = rule_fn(q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), g, beta, rec_state,
                      rows.query_start_loc, rows.slots, rows.has_initial)  # fmt: skip
        out = self.norm(out.reshape(n * hv, dv), z.reshape(n * hv, dv)).reshape(n, hv * dv)
        return ops.linear(out, self.out_proj.weight)
