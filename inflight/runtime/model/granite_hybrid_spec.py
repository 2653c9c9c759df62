"""The :class:`~.spec_types.ModelSpec` of a Granite 4 hybrid config (``GraniteMoeHybridForCausalLM``):
which layers are Mamba-2 (``layer_types``: ``mamba``/``linear_attention``) and their sizes
(:class:`~.spec_types.Mamba2Spec`), the attention layers (rotary only when ``position_embedding_type``
is ``rope``, else NoPE), the expert layers (``num_local_experts`` > 0: softmax over each token's
top-k router logits) with the shared MLP beside them (a dense MLP alone when there are no experts),
and the muP multipliers (embeddings, residual branches, attention scale, logits divisor). Reads
configs only; the model is :mod:`.granite_hybrid`.
"""

from __future__ import annotations

from typing import Any

from inflight.runtime.model.rope import rope_parameters
from inflight.runtime.model.spec_types import SUPPORTED_ROPE_TYPES, Mamba2Spec, ModelSpec, MoeSpec, shape_fields

_MAMBA_KINDS = ("mamba", "linear_attention")
_ATTENTION_KINDS = ("attention", "full_attention")


def granite_hybrid_spec(config: Any) -> ModelSpec:
    """The spec of a ``GraniteMoeHybridConfig`` (``ValueError`` for what is not implemented)."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only silu is implemented.")
    num_layers = config.num_hidden_layers
    kinds = list(config.layer_types or ())
    if len(kinds) != num_layers or set(kinds) - {*_MAMBA_KINDS, *_ATTENTION_KINDS}:
        raise ValueError(f"Granite 4 layer_types must name mamba or attention for each of the {num_layers} layers "
                         f"(got {kinds}).")  # fmt: skip
    uses_rope = getattr(config, "position_embedding_type", None) == "rope"
    if uses_rope:
        rope = rope_parameters(config)
        if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {rope.get('rope_type')!r}; supported: "
                             f"{', '.join(SUPPORTED_ROPE_TYPES)}.")  # fmt: skip
    mamba = _mamba(config, tuple(i for i, kind in enumerate(kinds) if kind in _MAMBA_KINDS))
    shape = {**shape_fields(config), "intermediate_size": int(config.shared_intermediate_size)}
    bias = bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        arch="granitemoehybrid", **shape,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False, sliding_window=None, hidden_act="silu",
        moe=_moe(config), embed_scale=float(config.embedding_multiplier), attn_scale=float(config.attention_multiplier),
        nope_layers=() if uses_rope else tuple(range(num_layers)),
        mamba=mamba if mamba.layers else None, residual_multiplier=float(config.residual_multiplier),
        logits_scaling=float(config.logits_scaling),
    )  # fmt: skip


def _mamba(config: Any, layers: tuple[int, ...]) -> Mamba2Spec:
    limit = tuple(float(x) for x in (config.time_step_limit or (0.0, float("inf"))))
    heads, groups = int(config.mamba_n_heads), int(config.mamba_n_groups)
    spec = Mamba2Spec(layers, heads, int(config.mamba_d_head), groups, int(config.mamba_d_state),
                      int(config.mamba_d_conv), bool(config.mamba_conv_bias), bool(config.mamba_proj_bias),
                      (limit[0], limit[1]))  # fmt: skip
    if heads % groups:
        raise ValueError(f"mamba_n_heads {heads} must be a multiple of mamba_n_groups {groups}.")
    if spec.conv_kernel < 2:
        raise ValueError(f"mamba_d_conv must be at least 2 (got {spec.conv_kernel}).")
    if spec.intermediate_size != int(config.mamba_expand * config.hidden_size):
        raise ValueError(f"mamba_n_heads * mamba_d_head ({spec.intermediate_size}) must equal mamba_expand * "
                         f"hidden_size ({int(config.mamba_expand * config.hidden_size)}).")  # fmt: skip
    return spec


def _moe(config: Any) -> MoeSpec | None:
    num_experts, top_k = int(config.num_local_experts or 0), int(config.num_experts_per_tok or 0)
    if num_experts == 0:
        return None
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts.")
    return MoeSpec(num_experts, top_k, int(config.intermediate_size), True, tuple(range(config.num_hidden_layers)),
                   topk_first=True, shared_intermediate_size=int(config.shared_intermediate_size))  # fmt: skip
