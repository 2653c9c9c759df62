"""The ModelSpec of a DeepSeek-V3 config (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi K2 and kin)
and of a DeepSeek-V2 one (``DeepseekV2ForCausalLM``: DeepSeek-V2, V2-Lite, V2.5, Coder-V2).

Attention is multi-head latent attention (:class:`~.spec_types.MlaSpec`, run by :mod:`.mla`): the
spec's ``num_kv_heads`` is 1 (one latent shared by every head, replicated on every tensor-parallel
rank) and its ``head_dim`` is the rope width (``qk_rope_head_dim``, what transformers' config calls
``head_dim`` and what the rope table is built for). The attention scale is ``qk_head_dim ** -0.5``
times yarn's ``mscale(factor, mscale_all_dim) ** 2`` when the rope is scaled, as transformers
computes it. The expert layers (from ``first_k_dense_replace`` on) route as GLM-4.5's do (sigmoid
scores, group-limited top-k with the correction bias, a shared expert): the same :class:`MoeSpec`.
fp8 block-quantized checkpoints (DeepSeek's published weights: ``quant_method`` fp8 with
``weight_block_size``) are refused with the reason.

DeepSeek-V2's attention is the same latent attention (its rotary is written with complex numbers
over feature pairs ``(2i, 2i + 1)``: DeepSeek-V3's interleaved layout, so ``rope_interleave``; V2-Lite
has no ``q_lora_rank``). Its experts route differently (:func:`softmax_grouped_moe`, run by
:func:`.moe.select_softmax_grouped_experts`): softmax scores, the top-k either over all experts
(``topk_method`` greedy) or within the ``topk_group`` groups of ``n_group`` whose best score is
highest (group_limited_greedy), no correction bias, weights times ``routed_scaling_factor``, and
``n_shared_experts`` shared experts beside them. Expert layers are those from
``first_k_dense_replace`` on that are multiples of ``moe_layer_freq`` (DeepSeek's own code and vLLM;
every published checkpoint has 1). Reads configs only.
"""

from __future__ import annotations

import math
from typing import Any

from inflight.runtime.model.family_specs import grouped_sigmoid_moe
from inflight.runtime.model.rope import rope_parameters
from inflight.runtime.model.spec_types import SUPPORTED_ROPE_TYPES, MlaSpec, ModelSpec, MoeSpec, shape_fields


def deepseek_v3_spec(config: Any) -> ModelSpec:
    """The spec of a ``deepseek_v3`` config (``ValueError`` for what is not served)."""
    return _mla_model_spec(config, "deepseek_v3", grouped_sigmoid_moe(config))


def deepseek_v2_spec(config: Any) -> ModelSpec:
    """The spec of a ``deepseek_v2`` config (``ValueError`` for what is not served)."""
    return _mla_model_spec(config, "deepseek_v2", softmax_grouped_moe(config))


def _mla_model_spec(config: Any, arch: str, moe: MoeSpec | None) -> ModelSpec:
    """A latent-attention decoder's spec: the MLA widths, the rope and its scale, and ``moe``."""
    _refuse_fp8(config)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only silu is implemented.")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope.get('rope_type')!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}.")  # fmt: skip
    mla = MlaSpec(
        q_lora_rank=int(config.q_lora_rank) if config.q_lora_rank else None, kv_lora_rank=int(config.kv_lora_rank),
        qk_nope_head_dim=int(config.qk_nope_head_dim), qk_rope_head_dim=int(config.qk_rope_head_dim),
        v_head_dim=int(config.v_head_dim), rope_interleave=bool(getattr(config, "rope_interleave", True)),
    )  # fmt: skip
    if mla.qk_rope_head_dim % 2 or mla.qk_rope_head_dim < 2:
        raise ValueError(f"qk_rope_head_dim {mla.qk_rope_head_dim} must be even.")
    shape = shape_fields(config)
    shape.update(num_kv_heads=1, head_dim=mla.qk_rope_head_dim)
    bias = bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        arch=arch, **shape,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False, sliding_window=None, hidden_act="silu",
        moe=moe, attn_scale=mla_scale(mla, rope), mla=mla,
    )  # fmt: skip


def softmax_grouped_moe(config: Any) -> MoeSpec | None:
    """DeepSeek-V2's expert layers (``ValueError`` for a routing it does not have)."""
    num_experts, top_k = int(config.n_routed_experts or 0), int(config.num_experts_per_tok or 0)
    method = getattr(config, "topk_method", "greedy") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"unsupported topk_method {method!r} for DeepSeek-V2; supported: greedy, "
                         "group_limited_greedy.")  # fmt: skip
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    sparse = tuple(i for i in range(int(config.first_k_dense_replace or 0), config.num_hidden_layers) if i % freq == 0)
    if not sparse or num_experts < 1:
        return None
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts.")
    groups, topk_groups = 1, 1
    if method == "group_limited_greedy":
        groups, topk_groups = int(config.n_group or 1), int(config.topk_group or 1)
        if num_experts % groups or not 1 <= topk_groups <= groups:
            raise ValueError(f"n_group {groups} must divide the {num_experts} experts and topk_group {topk_groups} "
                             "must be between 1 and n_group.")  # fmt: skip
        if top_k > topk_groups * (num_experts // groups):
            raise ValueError(f"num_experts_per_tok {top_k} exceeds the experts in topk_group {topk_groups} groups.")
    shared = int(config.moe_intermediate_size) * int(getattr(config, "n_shared_experts", 0) or 0)
    return MoeSpec(
        num_experts, top_k, int(config.moe_intermediate_size), bool(getattr(config, "norm_topk_prob", False)), sparse,
        scoring="softmax_grouped", num_groups=groups, topk_groups=topk_groups,
        routed_scaling_factor=float(config.routed_scaling_factor), shared_intermediate_size=shared,
    )  # fmt: skip


def mla_scale(mla: MlaSpec, rope: dict[str, Any]) -> float:
    """``(nope + rope dim) ** -0.5``, times ``mscale ** 2`` of a scaled rope with ``mscale_all_dim``
    (transformers' ``yarn_apply_mscale``)."""
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    if rope.get("rope_type", "default") != "default":
        mscale_all_dim = rope.get("mscale_all_dim", 0)
        factor = float(rope.get("factor", 1.0))
        if mscale_all_dim and factor > 1:
            mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


def _refuse_fp8(config: Any) -> None:
    qc = getattr(config, "quantization_config", None)
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    if str(getattr(method, "value", method)) == "fp8":
        block = qc.get("weight_block_size") if isinstance(qc, dict) else getattr(qc, "weight_block_size", None)
        raise ValueError(f"this DeepSeek-V3 checkpoint is fp8 block-quantized (weight_block_size {block}); inflight "
                         "has no fp8 block-scaled linear kernels, so it is not served. Convert it to bf16 first "
                         "(DeepSeek's fp8_cast_bf16.py, or a bf16 upload of the same model) and serve that.")
