"""The :class:`~.spec_types.ModelSpec` of a Qwen3-Next config (``Qwen3NextForCausalLM``): which layers
are linear attention (``layer_types``, which transformers fills from ``full_attention_interval``),
their sizes (:class:`~.spec_types.GatedDeltaSpec`), the gated full attention, partial rotary and the
expert layers with their gated shared expert. Reads configs only; the model is :mod:`.qwen3_next`.
"""

from __future__ import annotations

from typing import Any

from inflight.runtime.model.family_specs import rotary_dim_of
from inflight.runtime.model.rope import rope_parameters
from inflight.runtime.model.spec_types import (
    SUPPORTED_ROPE_TYPES,
    GatedDeltaSpec,
    ModelSpec,
    MoeSpec,
    shape_fields,
)


def qwen3_next_spec(config: Any) -> ModelSpec:
    """The spec of a ``Qwen3NextConfig`` (``ValueError`` for what is not implemented)."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only silu is implemented.")
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope.get('rope_type')!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}.")  # fmt: skip
    num_layers = config.num_hidden_layers
    kinds = list(config.layer_types)
    if len(kinds) != num_layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise ValueError(f"Qwen3-Next layer_types must name linear_attention or full_attention for each of the "
                         f"{num_layers} layers (got {kinds}).")  # fmt: skip
    linear = GatedDeltaSpec(
        tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
        config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
        config.linear_value_head_dim, config.linear_conv_kernel_dim,
    )  # fmt: skip
    if linear.num_v_heads % linear.num_k_heads:
        raise ValueError(f"linear_num_value_heads {linear.num_v_heads} must be a multiple of linear_num_key_heads "
                         f"{linear.num_k_heads}.")  # fmt: skip
    if linear.conv_kernel < 2:
        raise ValueError(f"linear_conv_kernel_dim must be at least 2 (got {linear.conv_kernel}).")
    shape = shape_fields(config)
    return ModelSpec(
        arch="qwen3_next", **shape,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(config, "attention_bias", False)), o_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=False, qk_norm=True, sliding_window=None, hidden_act="silu", moe=_moe(config),
        norm_plus_one=True, rotary_dim=rotary_dim_of(config, shape["head_dim"]), attn_output_gate=True,
        linear_attention=linear if linear.layers else None,
    )  # fmt: skip


def _moe(config: Any) -> MoeSpec | None:
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    dense = set(config.mlp_only_layers or ())
    sparse = tuple(i for i in range(config.num_hidden_layers)
                   if i not in dense and num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0)  # fmt: skip
    if not sparse:
        return None
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts.")
    return MoeSpec(
        num_experts,
        top_k,
        config.moe_intermediate_size,
        bool(config.norm_topk_prob),
        sparse,
        shared_intermediate_size=int(config.shared_expert_intermediate_size),
        shared_expert_gate=True,
    )
