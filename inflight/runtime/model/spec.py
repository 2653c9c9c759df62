"""ModelSpec: the architecture facts our decoder needs, read from a Hugging Face config.

Knows which architectures we support and how each differs from Llama (Qwen2's qkv bias,
Qwen3's q/k norm, sliding windows and which layers have them, Qwen3-MoE's, Mixtral's and
gpt-oss's expert layers, in :class:`MoeSpec`; gpt-oss's attention sinks; Phi-3/4, GLM-4.5 and Llama 4 in
:mod:`.family_specs`; DeepSeek-V3 in :mod:`.deepseek_spec`; Qwen3-Next's hybrid in :mod:`.qwen3_next_spec`). The spec dataclasses live in :mod:`.spec_types` and are re-exported here.
Raises ``ValueError`` for anything else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from inflight.runtime.model.deepseek_spec import deepseek_v2_spec, deepseek_v3_spec
from inflight.runtime.model.family_specs import family_spec
from inflight.runtime.model.granite_hybrid_spec import granite_hybrid_spec
from inflight.runtime.model.qwen3_next_spec import qwen3_next_spec
from inflight.runtime.model.spec_types import (
    SUPPORTED_ROPE_TYPES,
    ModelSpec,
    MoeSpec,
    shape_fields,
    sliding_layers_of,
)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",
    "Phi3ForCausalLM": "phi3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Llama4ForCausalLM": "llama4_text",
    "Qwen3NextForCausalLM": "qwen3_next",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",  # Granite 4: Mamba-2 + attention
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",  # MLA with DeepSeek-V2's softmax routing (model/deepseek_spec.py)
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",  # its decoder is Qwen2's; images: docs/vision.md
}
# Checkpoints with no LM head: a bare decoder (sentence-transformers' embedding models, saved by
# transformers' AutoModel) or a sequence classifier (a ``score`` head on the last token: rerankers).
# Served by the pooling runner only (docs/embeddings.md): architecture -> (arch, head).
POOLING_ARCHITECTURES = {
    "LlamaModel": ("llama", "none"),
    "MistralModel": ("mistral", "none"),
    "Qwen2Model": ("qwen2", "none"),
    "Qwen3Model": ("qwen3", "none"),
    "LlamaForSequenceClassification": ("llama", "score"),
    "MistralForSequenceClassification": ("mistral", "score"),
    "Qwen2ForSequenceClassification": ("qwen2", "score"),
    "Qwen3ForSequenceClassification": ("qwen3", "score"),
}
# BERT-family encoders (bidirectional, no KV cache: inflight.runtime.model.encoder), pooling
# runner only: architecture -> head.
ENCODER_ARCHITECTURES = {
    "BertModel": "none", "BertForSequenceClassification": "score",
    "RobertaModel": "none", "RobertaForSequenceClassification": "score",
    "XLMRobertaModel": "none", "XLMRobertaForSequenceClassification": "score",
}
# model_types that transformers builds one of our architecture classes for besides its own (its
# auto mappings list the class under them): a config pairing them is served, with a warning. Any
# other disagreement between ``architectures`` and ``model_type`` is refused (a test holds this
# table to transformers' mappings).
_LLAMA_ALIASES = ("exaone", "internlm3", "iquestcoder")
MODEL_TYPE_ALIASES = {"LlamaForCausalLM": _LLAMA_ALIASES, "LlamaModel": _LLAMA_ALIASES,
                      "Glm4MoeForCausalLM": ("sarvam_moe", "param2moe"),
                      "Llama4ForCausalLM": ("llama4",),  # the multimodal config: family_specs refuses it
                      "DeepseekV3ForCausalLM": ("sarvam_mla",)}
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "gpt_oss")
# Architectures refused with the reason they are not served (any other unknown one gets the
# generic message naming what is served).
REFUSED_ARCHITECTURES = {
    "Llama4ForConditionalGeneration": "Llama 4's vision-language checkpoint is not served (no image input); its "
    "text decoder is, as a Llama4ForCausalLM checkpoint (docs/models.md).",
}


def model_type_alias(config: Any) -> str | None:
    """A warning when ``config``'s ``architectures`` and ``model_type`` differ but transformers
    maps the pair (:data:`MODEL_TYPE_ALIASES`); ``None`` when they agree (or either is absent or
    not ours). A ``ValueError`` naming both when they disagree: transformers would build one model
    and we another."""
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    found = next(((a, POOLING_ARCHITECTURES[a][0] if a in POOLING_ARCHITECTURES else SUPPORTED_ARCHITECTURES[a])
                  for a in archs if a in POOLING_ARCHITECTURES or a in SUPPORTED_ARCHITECTURES), None)
    if found is None or not model_type or model_type == found[1]:
        return None
    name, arch = found
    if model_type in MODEL_TYPE_ALIASES.get(name, ()):
        return (f"config.json says architectures {name} and model_type {model_type!r}; transformers builds "
                f"{name} for {model_type!r} too, so it is served as {arch!r}")
    raise ValueError(f"config.json disagrees with itself: architectures {name} is a {arch!r} model but model_type "
                     f"is {model_type!r} (transformers would build a {model_type!r} model from it); fix one of the "
                     "two so they name the same architecture.")


def spec_from_hf_config(config: Any) -> ModelSpec:
    """Read a transformers ``PretrainedConfig`` into a :class:`ModelSpec` (``ValueError`` when its
    ``architectures`` and ``model_type`` disagree: :func:`model_type_alias`)."""
    model_type_alias(config)
    archs = list(getattr(config, "architectures", None) or [])
    pooled = next((POOLING_ARCHITECTURES[a] for a in archs if a in POOLING_ARCHITECTURES), None)
    if pooled is not None:
        return _pooling_spec(config, *pooled)
    encoder = next((ENCODER_ARCHITECTURES[a] for a in archs if a in ENCODER_ARCHITECTURES), None)
    if encoder is not None:
        return _encoder_spec(config, encoder)
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        model_type = getattr(config, "model_type", None)
        arch = model_type if model_type in SUPPORTED_ARCHITECTURES.values() else None
    refused = next((REFUSED_ARCHITECTURES[a] for a in archs if a in REFUSED_ARCHITECTURES), None)
    if arch is None and refused is not None:
        raise ValueError(f"unsupported architecture {archs!r}: {refused}")
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or getattr(config, 'model_type', None)!r}; "
            f"inflight serves {', '.join(sorted(SUPPORTED_ARCHITECTURES))} (see docs/models.md)."
        )
    if arch == "gemma3_text":
        return _gemma3_spec(config)
    if arch == "gpt_oss":
        return _gpt_oss_spec(config)
    if arch in ("phi3", "glm4_moe", "llama4_text"):
        return family_spec(config, arch)
    if arch == "qwen2_5_vl":  # Qwen2's decoder (text_config) with M-RoPE; the vision tower beside it
        return dataclasses.replace(_decoder_spec(config.text_config, "qwen2"), arch=arch,
                                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
    if arch == "qwen3_next":
        return qwen3_next_spec(config)
    if arch == "granitemoehybrid":  # Granite 4's hybrid (model/granite_hybrid.py)
        return granite_hybrid_spec(config)
    if arch == "deepseek_v3":  # multi-head latent attention (model/mla.py)
        return deepseek_v3_spec(config)
    if arch == "deepseek_v2":
        return deepseek_v2_spec(config)
    return _decoder_spec(config, arch)


def _pooling_spec(config: Any, arch: str, head: str) -> ModelSpec:
    """A Llama-family decoder with no LM head: a bare one, or one with a ``score`` head."""
    num_labels = int(getattr(config, "num_labels", 0) or 0) if head == "score" else 0
    if head == "score" and num_labels < 1:
        raise ValueError(f"a sequence classifier needs num_labels >= 1 in config.json (got {num_labels}).")
    return dataclasses.replace(_decoder_spec(config, arch), head=head, num_labels=num_labels,
                               tie_word_embeddings=False)


def _encoder_spec(config: Any, head: str) -> ModelSpec:
    """A BERT encoder's sizes (the pooling runner's :mod:`~inflight.runtime.model.encoder` runs it)."""
    num_labels = int(getattr(config, "num_labels", 0) or 0) if head == "score" else 0
    heads = config.num_attention_heads
    return ModelSpec(
        arch="bert", vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers, num_heads=heads,
        num_kv_heads=heads, head_dim=config.hidden_size // heads, rms_norm_eps=config.layer_norm_eps,
        max_position_embeddings=config.max_position_embeddings - _position_offset(config), tie_word_embeddings=False,
        qkv_bias=True,
        o_bias=True, mlp_bias=True, qk_norm=False, sliding_window=None, hidden_act=config.hidden_act,
        head=head, num_labels=num_labels,
    )  # fmt: skip


def _position_offset(config: Any) -> int:
    """RoBERTa numbers positions from ``pad_token_id + 1``: the table's first rows are never read."""
    if getattr(config, "model_type", "bert") in ("roberta", "xlm-roberta"):
        return int(config.pad_token_id) + 1
    return 0


def _decoder_spec(config: Any, arch: str) -> ModelSpec:
    """The Llama family (Llama, Mistral, Qwen2, Qwen3, their MoE kin) as ``arch``."""
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only silu is implemented.")
    _check_rope(_rope_parameters(config))
    sliding = getattr(config, "sliding_window", None)
    if arch in ("qwen2", "qwen3", "qwen3_moe") and not getattr(config, "use_sliding_window", False):
        sliding = None
    sliding_layers = sliding_layers_of(config, sliding)
    return ModelSpec(
        arch=arch,
        **shape_fields(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(getattr(config, "attention_bias", False)),
        o_bias=arch not in ("qwen2",) and bool(getattr(config, "attention_bias", False)),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        sliding_window=sliding if sliding_layers else None,
        hidden_act="silu",
        moe=_moe_spec(arch, config),
        sliding_layers=sliding_layers,
    )


def _check_rope(rope: dict[str, Any]) -> None:
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope.get('rope_type')!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )


def _gemma3_spec(config: Any) -> ModelSpec:
    """Gemma 3 text: local (sliding, ``rope_local_base_freq``) and global layers as
    ``layer_types`` says, GELU-tanh MLP, q/k norms, sandwich norms, scaled embeddings."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r}; only gelu_pytorch_tanh is implemented.")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("Gemma 3 attn_logit_softcapping is not supported (the attention kernels do not cap scores).")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma 3 use_bidirectional_attention is not supported: inflight serves causal decoders.")
    rope = _rope_parameters(config)  # per layer type: {"full_attention": {...}, "sliding_attention": {...}}
    for kind in ("full_attention", "sliding_attention"):
        _check_rope(dict(rope.get(kind) or {}))
    window = config.sliding_window
    sliding_layers = sliding_layers_of(config, window)
    return ModelSpec(
        arch="gemma3_text",
        **shape_fields(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        qkv_bias=bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)),
        mlp_bias=False,
        qk_norm=True,
        sliding_window=window if sliding_layers else None,
        hidden_act="gelu_pytorch_tanh",
        sliding_layers=sliding_layers,
        local_rope=True,
        norm_plus_one=True,
        sandwich_norms=True,
        embed_scale=config.hidden_size**0.5,
        attn_scale=config.query_pre_attn_scalar**-0.5,
        final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
    )


def _gpt_oss_spec(config: Any) -> ModelSpec:
    """gpt-oss: biased attention with a sink logit per head, sliding and full layers as
    ``layer_types`` says, yarn rope, and an expert layer in every layer (router bias, top-k then
    softmax, biased experts, clamped SwiGLU)."""
    _check_rope(_rope_parameters(config))
    window = config.sliding_window
    sliding_layers = sliding_layers_of(config, window)
    num_experts, top_k = config.num_local_experts, config.num_experts_per_tok
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts.")
    moe = MoeSpec(
        num_experts, top_k, config.intermediate_size, renormalize=True,
        sparse_layers=tuple(range(config.num_hidden_layers)), router_bias=True, topk_first=True,
        expert_bias=True, swiglu_limit=float(config.swiglu_limit), swiglu_alpha=float(config.swiglu_alpha),
    )  # fmt: skip
    bias = bool(getattr(config, "attention_bias", True))
    return ModelSpec(
        arch="gpt_oss",
        **shape_fields(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm=False,
        sliding_window=window if sliding_layers else None,
        hidden_act="silu",
        moe=moe,
        sliding_layers=sliding_layers,
        attn_sinks=True,
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
