"""The mixture-of-experts layer of Qwen3-MoE and Mixtral: a router and SwiGLU experts.

The router (a replicated ``[num_experts, hidden]`` matmul through ``KernelOps.linear``) picks
each token's top-k experts; the experts run through ``KernelOps.fused_moe`` (the torch
reference groups tokens by expert on the CPU; Triton on CUDA). Expert weights are stored
fused, as transformers 5 holds them in memory: ``experts.gate_up_proj`` ``[E, 2 * I, hidden]``
and ``experts.down_proj`` ``[E, hidden, I]``; :mod:`.moe_weights` fills them from either
checkpoint layout. Knows nothing about attention, scheduling or files.

Tensor parallelism slices every expert's intermediate dimension across the ranks, exactly as
the dense MLP is sliced (each rank holds ``I / N`` columns of all ``E`` experts, and one
all-reduce sums the partial outputs), rather than placing whole experts on ranks: every rank
then does the same work whatever the router picks (no rank idles while another holds the
popular experts), the router's choice needs no all-to-all exchange of tokens, any expert count
splits, and the layer reuses the dense MLP's single all-reduce. Whole experts per rank pays
off only at expert counts and batch sizes where an all-to-all beats the all-reduce, across
nodes; that is expert parallelism, not done here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from inflight.kernels.dispatch import KernelOps
from inflight.runtime.distributed.layout import ShardLayout
from inflight.runtime.model.spec import ModelSpec

if TYPE_CHECKING:
    from inflight.runtime.distributed.comm import TensorParallel


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32 weights, int64 expert ids
    """Softmax over all experts in float32, the ``top_k`` most probable, and (``renormalize``)
    their probabilities divided by their sum, which equals a softmax over the top-k logits
    (Mixtral always; Qwen3-MoE when ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_width_per_rank(spec: ModelSpec, layout: ShardLayout) -> int:
    """Columns of each expert's intermediate dimension this rank holds."""
    assert spec.moe is not None
    return spec.moe.intermediate_size // layout.world_size


class Experts(nn.Module):
    """Every expert's SwiGLU weights, this rank's intermediate columns of each."""

    def __init__(self, num_experts: int, hidden_size: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden_size))  # gate, then up rows
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, width))


class SparseMoe(nn.Module):
    """A decoder layer's MLP when it is an expert layer: route, run the experts, all-reduce."""

    def __init__(self, spec: ModelSpec, layout: ShardLayout, tp: TensorParallel | None) -> None:
        super().__init__()
        moe = spec.moe
        if moe is None:
            raise ValueError(f"the {spec.arch} spec has no expert layers.")
        self.tp = tp
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)  # the router, on every rank
        self.experts = Experts(moe.num_experts, spec.hidden_size, expert_width_per_rank(spec, layout))

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [num_tokens, hidden]
        router_logits = ops.linear(x, self.gate.weight)  # [num_tokens, num_experts]
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = ops.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        return out if self.tp is None else self.tp.all_reduce(out)
