"""The mixture-of-experts layer of Qwen3-MoE, Mixtral and gpt-oss: a router and SwiGLU experts.

The router (a replicated ``[num_experts, hidden]`` matmul through ``KernelOps.linear``) picks
each token's top-k experts; the experts run through ``KernelOps.fused_moe`` (the torch
reference groups tokens by expert on the CPU; Triton on CUDA). Expert weights are stored
fused, as transformers 5 holds them in memory: ``experts.gate_up_proj`` ``[E, 2 * I, hidden]``
and ``experts.down_proj`` ``[E, hidden, I]``; :mod:`.moe_weights` fills them from either
checkpoint layout. gpt-oss adds a router bias, routes by top-k of the logits then a softmax
over those k, biases on both expert matmuls (``experts.gate_up_proj_bias`` ``[E, 2 * I]``,
gate then up; ``experts.down_proj_bias`` ``[E, hidden]``) and the clamped SwiGLU. Knows
nothing about attention, scheduling or files.

Tensor parallelism slices every expert's intermediate dimension across the ranks, exactly as
the dense MLP is sliced (each rank holds ``I / N`` columns of all ``E`` experts, and one
all-reduce sums the partial outputs), rather than placing whole experts on ranks: every rank
then does the same work whatever the router picks (no rank idles while another holds the
popular experts), the router's choice needs no all-to-all exchange of tokens, any expert count
splits, and the layer reuses the dense MLP's single all-reduce. Whole experts per rank pays
off only at expert counts and batch sizes where an all-to-all beats the all-reduce, across
nodes; that is expert parallelism, not done here. gpt-oss's biases split the same way: the
gate/up bias with its columns; the down bias, added to every rank's partial sum, is held by
rank 0 only (zeros elsewhere), so the all-reduce adds it once (the loader sees to it).
"""

from __future__ import annotations

import torch
from torch import nn

from inflight.kernels.ops import KernelOps
from inflight.kernels.reference import ClampedSwiglu
from inflight.runtime.model.collectives import Collectives
from inflight.runtime.model.layout import ShardLayout
from inflight.runtime.model.spec import ModelSpec


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
    topk_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32 weights, int64 expert ids
    """Softmax over all experts in float32, the ``top_k`` most probable, and (``renormalize``)
    their probabilities divided by their sum, which equals a softmax over the top-k logits
    (Mixtral always; Qwen3-MoE when ``norm_topk_prob``). ``topk_first`` (gpt-oss) takes the
    ``top_k`` largest logits and a float32 softmax over those, in transformers' order."""
    if topk_first:
        top_logits, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(top_logits.float(), dim=-1), ids
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

    def __init__(self, num_experts: int, hidden_size: int, width: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden_size))  # gate, then up rows
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, width))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * width)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None


class SparseMoe(nn.Module):
    """A decoder layer's MLP when it is an expert layer: route, run the experts, all-reduce."""

    def __init__(self, spec: ModelSpec, layout: ShardLayout, tp: Collectives | None) -> None:
        super().__init__()
        moe = spec.moe
        if moe is None:
            raise ValueError(f"the {spec.arch} spec has no expert layers.")
        self.tp = tp
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.topk_first = moe.topk_first
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=moe.router_bias)  # the router, on every rank
        width = expert_width_per_rank(spec, layout)
        self.experts = Experts(moe.num_experts, spec.hidden_size, width, moe.expert_bias)
        limit = moe.swiglu_limit
        self.activation = None if limit is None else ClampedSwiglu(moe.swiglu_alpha, limit)

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [num_tokens, hidden]
        router_logits = ops.linear(x, self.gate.weight, self.gate.bias)  # [num_tokens, num_experts]
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize, self.topk_first)
        experts = self.experts
        options = {}  # gpt-oss only: the other families' calls stay as they were
        if experts.gate_up_proj_bias is not None:
            options = {"w13_bias": experts.gate_up_proj_bias, "w2_bias": experts.down_proj_bias}
        if self.activation is not None:
            options["activation"] = self.activation
        out = ops.fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids, **options)
        return out if self.tp is None else self.tp.all_reduce(out)
