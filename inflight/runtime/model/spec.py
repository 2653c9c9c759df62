"""ModelSpec: the architecture facts our decoder needs, read from a Hugging Face config.

Knows which architectures we support and how each differs from Llama (Qwen2's qkv bias,
Qwen3's q/k norm, Mistral's sliding window, Qwen3-MoE's and Mixtral's expert layers, in
:class:`MoeSpec`). Raises ``ValueError`` for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The expert layers of a mixture-of-experts decoder (no shared experts)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's MLP width
    renormalize: bool  # divide the top-k softmax probabilities by their sum
    sparse_layers: tuple[int, ...]  # decoder layers whose MLP is the expert layer; the rest are dense


@dataclass(frozen=True, slots=True)
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    hidden_act: str
    moe: MoeSpec | None = None  # None: every layer a dense MLP


def spec_from_hf_config(config: Any) -> ModelSpec:
    """Read a transformers ``PretrainedConfig`` into a :class:`ModelSpec`."""
    archs = list(getattr(config, "architectures", None) or [])
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        model_type = getattr(config, "model_type", None)
        arch = model_type if model_type in SUPPORTED_ARCHITECTURES.values() else None
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or getattr(config, 'model_type', None)!r}; "
            f"inflight serves {', '.join(sorted(SUPPORTED_ARCHITECTURES))} (see docs/models.md)."
        )
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only silu is implemented.")
    rope = _rope_parameters(config)
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope.get('rope_type')!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    sliding = getattr(config, "sliding_window", None)
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not getattr(config, "use_sliding_window", False):
        sliding = None
    return ModelSpec(
        arch=arch,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(getattr(config, "attention_bias", False)),
        o_bias=arch not in ("qwen2",) and bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        sliding_window=sliding,
        hidden_act="silu",
        moe=_moe_spec(arch, config),
    )


def _moe_spec(arch: str, config: Any) -> MoeSpec | None:
    """Qwen3-MoE: softmax over all experts, top-k, renormalised when ``norm_topk_prob``; the
    layers in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid stay dense. Mixtral:
    the same routing, always renormalised (a softmax over the top-k logits), every layer sparse."""
    if arch not in MOE_ARCHITECTURES:
        return None
    layers = range(config.num_hidden_layers)
    if arch == "mixtral":
        num_experts, width, renormalize = config.num_local_experts, config.intermediate_size, True
        sparse = tuple(layers)
    else:
        num_experts, width = config.num_experts, config.moe_intermediate_size
        renormalize = bool(config.norm_topk_prob)
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = config.decoder_sparse_step
        sparse = tuple(i for i in layers if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    if not sparse:
        return None
    top_k = config.num_experts_per_tok
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts.")
    return MoeSpec(num_experts, top_k, width, renormalize, sparse)


def _rope_parameters(config: Any) -> dict[str, Any]:
    from inflight.runtime.model.rope import rope_parameters

    return rope_parameters(config)
