"""ModelSpecs of the families that reuse the Llama decoder with a twist: Phi-3/Phi-4, GLM-4.5/4.6, Llama 4.

Phi-3/Phi-4 (``Phi3ForCausalLM``): checkpoint tensors fused as ``qkv_proj`` and ``gate_up_proj``
(the loader splits them per rank), rotary over ``partial_rotary_factor`` of each head, LongRoPE
(``rope_type`` longrope, ex su/yarn: :func:`inflight.runtime.model.rope.build_cos_sin_cache`) and a
sliding window on every layer when ``sliding_window`` is set. GLM-4.5/4.6 (``Glm4MoeForCausalLM``):
qkv bias, optional q/k norms, partial rotary, ``first_k_dense_replace`` dense layers, then expert
layers with sigmoid group-limited routing and a shared expert (:class:`~.spec.MoeSpec`). Llama 4
text (``Llama4ForCausalLM``): chunked attention on the RoPE layers, NoPE layers with attention
temperature tuning, an L2 q/k norm, and expert layers (``interleave_moe_layer_step``) with a
sigmoid top-1 router scaling the expert's input and a shared expert (:mod:`.llama4`). Reads
configs only; knows nothing about weights or kernels.
"""

from __future__ import annotations

from typing import Any

from inflight.runtime.model.rope import rope_parameters
from inflight.runtime.model.spec_types import (
    SUPPORTED_ROPE_TYPES,
    ModelSpec,
    MoeSpec,
    shape_fields,
    sliding_layers_of,
)

PHI3_ROPE_TYPES = ("default", "longrope")


def family_spec(config: Any, arch: str) -> ModelSpec:
    """The spec of a ``phi3`` or ``glm4_moe`` config (``ValueError`` for what is not implemented)."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only silu is implemented.")
    if arch == "phi3":
        return _phi3_spec(config)
    if arch == "glm4_moe":
        return _glm4_moe_spec(config)
    if arch == "llama4_text":
        return _llama4_spec(config)
    raise ValueError(f"no family spec for {arch!r}")


def rotary_dim_of(config: Any, head_dim: int) -> int | None:
    """``head_dim * partial_rotary_factor`` (None when the factor is 1: every feature rotates)."""
    factor = float(rope_parameters(config).get("partial_rotary_factor", 1.0) or 1.0)
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1] (got {factor}).")
    dim = int(head_dim * factor)
    if dim % 2:
        raise ValueError(f"head_dim {head_dim} x partial_rotary_factor {factor} = {dim} rotary features: must be even.")
    return None if dim == head_dim else dim


def _phi3_spec(config: Any) -> ModelSpec:
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in PHI3_ROPE_TYPES:
        raise ValueError(f"unsupported Phi-3 rope type {rope.get('rope_type')!r}; supported: "
                         f"{', '.join(PHI3_ROPE_TYPES)}.")  # fmt: skip
    shape = shape_fields(config)
    window = getattr(config, "sliding_window", None)
    sliding_layers = sliding_layers_of(config, window)
    return ModelSpec(
        arch="phi3", **shape,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
        sliding_window=window if sliding_layers else None, hidden_act="silu", sliding_layers=sliding_layers,
        rotary_dim=rotary_dim_of(config, shape["head_dim"]),
    )  # fmt: skip


def _glm4_moe_spec(config: Any) -> ModelSpec:
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope.get('rope_type')!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}.")  # fmt: skip
    shape = shape_fields(config)
    return ModelSpec(
        arch="glm4_moe", **shape,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bool(getattr(config, "attention_bias", False)), o_bias=False, mlp_bias=False,
        qk_norm=bool(getattr(config, "use_qk_norm", False)), sliding_window=None, hidden_act="silu",
        moe=_glm4_moe(config), rotary_dim=rotary_dim_of(config, shape["head_dim"]),
    )  # fmt: skip


def _glm4_moe(config: Any) -> MoeSpec | None:
    """Layers from ``first_k_dense_replace`` on are expert layers: ``n_routed_experts`` experts,
    ``num_experts_per_tok`` a token, from the ``topk_group`` best of ``n_group`` groups."""
    num_experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    groups, topk_groups = int(config.n_group or 1), int(config.topk_group or 1)
    sparse = tuple(range(int(config.first_k_dense_replace), config.num_hidden_layers))
    if not sparse or num_experts < 1:
        return None
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts.")
    if num_experts % groups or not 1 <= topk_groups <= groups:
        raise ValueError(f"n_group {groups} must divide the {num_experts} experts and topk_group {topk_groups} "
                         "must be between 1 and n_group.")  # fmt: skip
    if num_experts // groups < 2:
        raise ValueError(f"each of the n_group {groups} expert groups needs at least 2 experts (its score is "
                         "the sum of its best two).")  # fmt: skip
    if top_k > topk_groups * (num_experts // groups):
        raise ValueError(f"num_experts_per_tok {top_k} exceeds the experts in topk_group {topk_groups} groups.")
    shared = int(config.moe_intermediate_size) * int(getattr(config, "n_shared_experts", 0) or 0)
    return MoeSpec(
        num_experts, top_k, config.moe_intermediate_size, bool(config.norm_topk_prob), sparse,
        scoring="sigmoid", score_correction_bias=True, num_groups=groups, topk_groups=topk_groups,
        routed_scaling_factor=float(config.routed_scaling_factor), shared_intermediate_size=shared,
    )  # fmt: skip


grouped_sigmoid_moe = _glm4_moe  # DeepSeek-V3's experts route the same way (model/deepseek_spec.py)


def _llama4_spec(config: Any) -> ModelSpec:
    """Llama 4 text: dense layers ``intermediate_size_mlp`` wide, expert layers (``moe_layers``) of
    ``intermediate_size``-wide experts plus an equally wide shared expert."""
    if getattr(config, "text_config", None) is not None:
        raise ValueError("config.json is Llama 4's multimodal config (model_type llama4); inflight serves the text "
                         "decoder from a Llama4TextConfig (model_type llama4_text) checkpoint.")  # fmt: skip
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope.get('rope_type')!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}.")  # fmt: skip
    num_layers = config.num_hidden_layers
    use_rope = list(config.no_rope_layers)  # 1: a RoPE layer, 0: a NoPE layer
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    chunk = getattr(config, "attention_chunk_size", None)
    chunked = [i for i, kind in enumerate(layer_types) if kind == "chunked_attention"]
    if chunked and (chunk is None or chunk < 1):
        raise ValueError(f"layers {chunked} are chunked_attention but attention_chunk_size is {chunk!r}.")
    if any(not use_rope[i] for i in chunked):
        raise ValueError("a NoPE layer with chunked attention is not a Llama 4 shape; not supported.")
    if {kind for kind in layer_types} - {"chunked_attention", "full_attention"}:
        raise ValueError(f"unsupported Llama 4 layer_types {sorted(set(layer_types))}.")
    top_k, num_experts = config.num_experts_per_tok, config.num_local_experts
    moe_layers = tuple(getattr(config, "moe_layers", None) or ())
    moe = None
    if moe_layers:
        if top_k != 1:  # the scores scale the input: k > 1 would run each expert on k scaled inputs
            raise ValueError(f"Llama 4 with num_experts_per_tok {top_k} is not supported (every Llama 4 routes to 1).")
        moe = MoeSpec(
            num_experts, 1, config.intermediate_size, False, moe_layers, scoring="sigmoid_input",
            shared_intermediate_size=config.intermediate_size,
        )  # fmt: skip
    shape = shape_fields(config)
    shape["intermediate_size"] = config.intermediate_size_mlp
    tuning = bool(getattr(config, "attn_temperature_tuning", False))
    bias = bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        arch="llama4_text", **shape,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False, sliding_window=None, hidden_act="silu",
        moe=moe, attention_chunk_size=chunk if chunked else None, chunked_layers=tuple(chunked),
        nope_layers=tuple(i for i in range(num_layers) if not use_rope[i]),
        l2_qk_norm=bool(getattr(config, "use_qk_norm", False)),
        attn_temperature=(float(config.floor_scale), float(config.attn_scale)) if tuning else None,
    )  # fmt: skip
