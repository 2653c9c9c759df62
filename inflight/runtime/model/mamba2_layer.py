"""The Mamba-2 mixer (Granite 4's ``mamba`` layers) over a packed batch with per-sequence state.

Each running sequence holds a slot of the state pool (:mod:`inflight.runtime.core.state_pool`):
per Mamba-2 layer a conv state ``[conv_dim, conv_kernel - 1]`` (the last inputs of the causal
conv, in the model's dtype) and an SSM state ``[num_heads, head_dim, d_state]`` (float32). The
runner allocates the pool tensors (:func:`state_shapes`, through
:mod:`inflight.runtime.worker.hybrid_cache`) and hands them to the layer in the place an attention
layer gets its KV cache; :class:`~.gated_delta_layer.StateRows` says each sequence's slot and
whether it continues from it (decode, a later prompt chunk) or starts from zeros; a step with
speculating chunks runs their rows position by position (:func:`~.gated_delta_layer.run_state_op`).

The layer: ``in_proj`` -> (z, xBC, dt); the causal depthwise conv (with bias, SiLU) over xBC;
x split into heads, B and C into ``num_groups`` groups; ``dt = clamp(softplus(dt + dt_bias),
dt_limit)``, ``A = -exp(A_log)``; the SSD recurrence with the ``D`` skip; ``y * silu(z)`` then
an RMSNorm over each group's ``intermediate / num_groups`` features (transformers'
``norm_before_gate=False``); ``out_proj``. The conv and scan run through :func:`kernels_for`
(Triton for the Triton bundle; the native CPU bundle's decode rows in C; else the torch references
of :mod:`inflight.kernels.mamba2_reference`). Knows nothing about scheduling; unsharded only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from inflight.kernels import mamba2_reference
from inflight.kernels.ops import KernelOps
from inflight.runtime.model.gated_delta_layer import StateRows, run_state_op
from inflight.runtime.model.spec_types import Mamba2Spec


def state_shapes(spec: Mamba2Spec, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one Mamba-2 layer's conv-state and SSM-state pool tensors."""
    return ((num_slots, spec.conv_dim, spec.conv_kernel - 1),
            (num_slots, spec.num_heads, spec.head_dim, spec.state_size))  # fmt: skip


KernelFn = Callable[..., torch.Tensor]


def kernels_for(ops: KernelOps) -> tuple[KernelFn, KernelFn]:
    """(causal_conv1d, ssd_scan) for the bundle: Triton's for the Triton bundle; on the native CPU
    bundle the scan's decode rows in C (:mod:`inflight.kernels.cpu_mamba2`); else the references."""
    if ops.name.startswith("triton"):
        from inflight.kernels import triton_mamba2

        return triton_mamba2.causal_conv1d, triton_mamba2.ssd_scan
    if ops.name.startswith("cpu-native"):
        from inflight.kernels import cpu_mamba2

        return mamba2_reference.causal_conv1d, cpu_mamba2.ssd_scan
    return mamba2_reference.causal_conv1d, mamba2_reference.ssd_scan


class GroupGatedRMSNorm(nn.Module):
    """``x * silu(gate)``, then an RMSNorm over each ``group_size`` features, times the weight (float32)."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [num_tokens, size]
        h = x.float() * F.silu(gate.float())
        groups = h.view(h.shape[0], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view_as(h).to(x.dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer (checkpoint name ``mamba``)."""

    def __init__(self, hidden_size: int, spec: Mamba2Spec, eps: float) -> None:
        super().__init__()
        self.spec = spec
        inner, heads = spec.intermediate_size, spec.num_heads
        self.in_proj = nn.Linear(hidden_size, inner + spec.conv_dim + heads, bias=spec.proj_bias)
        self.conv1d = nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.conv_kernel, groups=spec.conv_dim,
                                bias=spec.conv_bias)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = GroupGatedRMSNorm(inner, inner // spec.num_groups, eps)
        self.out_proj = nn.Linear(inner, hidden_size, bias=spec.proj_bias)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor], rows: StateRows,
                ops: KernelOps) -> torch.Tensor:  # fmt: skip
        """``x`` ``[num_tokens, hidden]``; ``state``: this layer's (conv, SSM) pool tensors."""
        spec = self.spec
        n, inner, gn = x.shape[0], spec.intermediate_size, spec.num_groups * spec.state_size
        proj = ops.linear(x, self.in_proj.weight, self.in_proj.bias)
        z, xbc, dt = proj.split([inner, spec.conv_dim, spec.num_heads], dim=-1)
        conv_fn, scan_fn = kernels_for(ops)
        conv_state, ssm_state = state
        weight, conv_bias = self.conv1d.weight[:, 0, :], self.conv1d.bias
        conv_in = xbc
        xbc = run_state_op(lambda sel, starts, slots, init: conv_fn(conv_in[sel], weight, conv_bias, conv_state, starts,
                                                                    slots, init), rows, conv_state, n)  # fmt: skip
        xs, b, c = xbc.split([inner, gn, gn], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*spec.dt_limit)
        a = -torch.exp(self.A_log.float())
        xs, b, c = xs.reshape(n, spec.num_heads, spec.head_dim), b.reshape(n, spec.num_groups, -1), \
            c.reshape(n, spec.num_groups, -1)  # fmt: skip
        d = self.D
        y = run_state_op(lambda sel, starts, slots, init: scan_fn(xs[sel], dt[sel], a, b[sel], c[sel], d, ssm_state,
                                                                  starts, slots, init), rows, ssm_state, n)  # fmt: skip
        y = self.norm(y.reshape(n, inner), z)
        return ops.linear(y.to(x.dtype), self.out_proj.weight, self.out_proj.bias)
