"""The mixture-of-experts layer of Qwen3-MoE, Mixtral, gpt-oss, GLM-4.5 and DeepSeek: a router and SwiGLU experts.

The router (a replicated ``[num_experts, hidden]`` matmul through ``KernelOps.linear``) picks
each token's top-k experts; the experts run through ``KernelOps.fused_moe`` (the torch
reference groups tokens by expert on the CPU; Triton on CUDA). Expert weights are stored
fused, as transformers 5 holds them in memory: ``experts.gate_up_proj`` ``[E, 2 * I, hidden]``
and ``experts.down_proj`` ``[E, hidden, I]``; :mod:`.moe_weights` fills them from either
checkpoint layout. GLM-4.5 routes by sigmoid scores in float32 (:func:`select_grouped_experts`)
and adds a dense shared expert (``shared_experts``, a :class:`~.decoder.MLP`-shaped SwiGLU whose
partial sum joins the experts' before the one all-reduce). Llama 4 routes each token to its top-1
expert by logit and scales the expert's *input* by the sigmoid of that logit (the expert then gets
weight 1), with a shared expert as GLM's. DeepSeek-V3 routes as GLM-4.5; DeepSeek-V2 by float32
softmax scores, within the best groups by their top score when group-limited
(:func:`select_softmax_grouped_experts`), shared experts as GLM's. gpt-oss adds a router bias,
routes by top-k of the logits then a softmax over those k, biases on both expert matmuls
(``experts.gate_up_proj_bias`` ``[E, 2 * I]``, gate then up; ``experts.down_proj_bias``
``[E, hidden]``) and the clamped SwiGLU. Knows nothing about attention, scheduling or files.

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
from inflight.runtime.model.spec import ModelSpec, MoeSpec


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


def select_grouped_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] float32
    correction_bias: torch.Tensor,  # [num_experts]
    moe: MoeSpec,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32 weights, int64 expert ids
    """GLM-4.5 / DeepSeek-V3 routing: sigmoid scores; each of ``num_groups`` groups scored by the
    sum of its two best bias-corrected scores; the top-k bias-corrected experts within the
    ``topk_groups`` best groups; weights their uncorrected scores (divided by their sum when
    ``renormalize``) times ``routed_scaling_factor``."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction_bias.float()
    num_tokens, num_experts = choice.shape
    grouped = choice.view(num_tokens, moe.num_groups, num_experts // moe.num_groups)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [num_tokens, num_groups]
    best_groups = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    choice = choice.masked_fill(~keep.repeat_interleave(num_experts // moe.num_groups, dim=1), float("-inf"))
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


def select_softmax_grouped_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] float32
    moe: MoeSpec,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, top_k] float32 weights, int64 expert ids
    """DeepSeek-V2 routing: float32 softmax scores; with ``num_groups`` > 1 (group_limited_greedy)
    only the experts of the ``topk_groups`` groups whose best score is highest stay in the running;
    the top-k scores (divided by their sum when ``renormalize``) times ``routed_scaling_factor``."""
    scores = torch.softmax(router_logits.float(), dim=-1)
    if moe.num_groups > 1:
        num_tokens, num_experts = scores.shape
        group_scores = scores.view(num_tokens, moe.num_groups, -1).max(dim=-1).values  # [num_tokens, num_groups]
        best_groups = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        scores = scores.masked_fill(~keep.repeat_interleave(num_experts // moe.num_groups, dim=1), 0.0)
    weights, ids = torch.topk(scores, k=moe.top_k, dim=-1, sorted=False)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class SharedExpert(nn.Module):
    """GLM-4.5's shared expert: a SwiGLU every token passes, this rank's columns of it (no all-reduce)."""

    def __init__(self, hidden_size: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * width, bias=False)  # gate rows, then up rows
        self.down_proj = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [num_tokens, hidden], a partial sum
        act = ops.silu_and_mul(ops.linear(x, self.gate_up_proj.weight))
        return ops.linear(act, self.down_proj.weight)


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
        self.moe = moe
        if moe.score_correction_bias:  # checkpoint name: mlp.gate.e_score_correction_bias
            self.gate.register_parameter("e_score_correction_bias", nn.Parameter(torch.empty(moe.num_experts)))
        shared = moe.shared_intermediate_size // layout.world_size
        self.shared_experts = SharedExpert(spec.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [num_tokens, hidden]
        routed_in = x  # the routed experts' input (Llama 4 scales it by the router score)
        if self.moe.scoring == "sigmoid":  # GLM-4.5 (transformers runs this matmul in float32; we in the model's dtype)
            router_logits = ops.linear(x, self.gate.weight).float()  # [num_tokens, num_experts]
            weights, ids = select_grouped_experts(router_logits, self.gate.e_score_correction_bias, self.moe)
        elif self.moe.scoring == "softmax_grouped":  # DeepSeek-V2
            router_logits = ops.linear(x, self.gate.weight).float()  # [num_tokens, num_experts]
            weights, ids = select_softmax_grouped_experts(router_logits, self.moe)
        elif self.moe.scoring == "sigmoid_input":  # Llama 4: top-1 by logit, its sigmoid scales the input
            top_logits, ids = torch.topk(ops.linear(x, self.gate.weight), 1, dim=-1)  # [num_tokens, 1]
            routed_in = x * torch.sigmoid(top_logits.float()).to(x.dtype)
            weights = torch.ones(ids.shape, dtype=torch.float32, device=x.device)
        else:
            router_logits = ops.linear(x, self.gate.weight, self.gate.bias)  # [num_tokens, num_experts]
            weights, ids = select_experts(router_logits, self.top_k, self.renormalize, self.topk_first)
        experts = self.experts
        options = {}  # gpt-oss only: the other families' calls stay as they were
        if experts.gate_up_proj_bias is not None:
            options = {"w13_bias": experts.gate_up_proj_bias, "w2_bias": experts.down_proj_bias}
        if self.activation is not None:
            options["activation"] = self.activation
        out = ops.fused_moe(routed_in, experts.gate_up_proj, experts.down_proj, weights, ids, **options)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, ops)
        return out if self.tp is None else self.tp.all_reduce(out)
