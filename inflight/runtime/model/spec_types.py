"""The architecture facts our decoder needs, as values: :class:`ModelSpec`, :class:`MoeSpec`, and
the config readers every family shares (sizes, which layers are windowed). Re-exported by
:mod:`.spec`, which knows the architectures; this module knows none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The expert layers of a mixture-of-experts decoder (GLM-4.5: a shared expert beside them)."""

    num_experts: int
    top_k: int  # experts per token
    intermediate_size: int  # each expert's MLP width
    renormalize: bool  # divide the top-k softmax probabilities by their sum
    sparse_layers: tuple[int, ...]  # decoder layers whose MLP is the expert layer; the rest are dense
    # gpt-oss (all defaults: Qwen3-MoE and Mixtral): a router bias, top-k of the logits then a
    # softmax over those k, a bias on each expert matmul, the clamped SwiGLU.
    router_bias: bool = False
    topk_first: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None  # set: the clamped SwiGLU (kernels.reference.ClampedSwiglu)
    swiglu_alpha: float = 1.0
    # GLM-4.5 (all defaults: the others): sigmoid scores, the top-k picked by score plus a learned
    # correction bias (``gate.e_score_correction_bias``) within the ``topk_groups`` best of
    # ``num_groups`` expert groups, weights the picked sigmoid scores (renormalised when
    # ``renormalize``) times ``routed_scaling_factor``; and a dense shared expert of
    # ``shared_intermediate_size`` columns added to every token (0: none).
    # Llama 4: "sigmoid_input": sigmoid of each token's top-k router logits scales the expert's
    # input (not its output); a shared expert as GLM's.
    scoring: str = "softmax"  # or "sigmoid", "sigmoid_input", "softmax_grouped" (DeepSeek-V2: model/moe.py)
    score_correction_bias: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False  # Qwen3-Next: the shared expert's output times sigmoid(x @ gate.T)


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2: :mod:`.mla`): queries through a
    ``q_lora_rank`` bottleneck (None: one ``q_proj``), keys and values from one normed latent of
    ``kv_lora_rank`` per token plus a shared ``qk_rope_head_dim`` roped key: the two are what the
    paged cache holds. ``rope_interleave``: the checkpoint's rotary features come in pairs."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool


@dataclass(frozen=True, slots=True)
class GatedDeltaSpec:
    """Qwen3-Next's linear-attention (Gated DeltaNet) layers: which layers, and their sizes. Each
    running sequence holds a conv state and a recurrent state per such layer (a state-pool slot)."""

    layers: tuple[int, ...]  # the linear-attention layers; the others are (gated) full attention
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:  # channels of the causal conv: q, k and v together
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass(frozen=True, slots=True)
class Mamba2Spec:
    """The Mamba-2 layers of a hybrid decoder (Granite 4: :mod:`.mamba2_layer`): which layers, and
    their sizes. Each running sequence holds a conv state and an SSM state per such layer (a slot)."""

    layers: tuple[int, ...]  # the Mamba-2 layers; the others are attention
    num_heads: int
    head_dim: int
    num_groups: int  # B and C are shared by num_heads / num_groups consecutive heads
    state_size: int  # d_state
    conv_kernel: int  # d_conv
    conv_bias: bool
    proj_bias: bool  # in_proj and out_proj
    dt_limit: tuple[float, float]  # softplus(dt + dt_bias) clamped to it

    @property
    def intermediate_size(self) -> int:  # x (and z) width: heads times head_dim
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:  # channels of the causal conv: x, B and C together
        return self.intermediate_size + 2 * self.num_groups * self.state_size


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
    sliding_window: int | None  # the window of the layers in sliding_layers; None: no window anywhere
    hidden_act: str
    moe: MoeSpec | None = None  # None: every layer a dense MLP
    sliding_layers: tuple[int, ...] = ()  # layers whose attention is windowed (see sliding_layers_of)
    # Gemma 3 (all defaults: the Llama family): sliding layers rotate with their own rope base
    # (table 1 of the rope tables), RMSNorm scales by (1 + weight) (the loader adds the 1), a
    # norm before and after the MLP as well as after attention, embeddings times
    # sqrt(hidden_size), 1/sqrt(query_pre_attn_scalar) attention scale, tanh-capped logits.
    local_rope: bool = False
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None
    attn_sinks: bool = False  # gpt-oss: a learned logit per head in every attention softmax
    # What sits on the final norm: "lm" (the LM head), "none" (a bare decoder: embeddings) or
    # "score" (a sequence classifier's [num_labels, hidden] head, read at the last token).
    head: str = "lm"
    num_labels: int = 0  # the score head's outputs ("score" only)
    # Phi-3/4, GLM-4.5: rotary over the first ``rotary_dim`` features of each head (None: all of them).
    rotary_dim: int | None = None
    # Llama 4 (all defaults: the others): the RoPE layers attend within ``attention_chunk_size``
    # chunks (keys of the query's own chunk only), the ``nope_layers`` skip rotary and, with
    # ``attn_temperature`` (floor_scale, attn_scale), scale queries by position; ``l2_qk_norm``: a
    # weightless RMS norm of q and k after rotary on the RoPE layers (model/llama4.py).
    attention_chunk_size: int | None = None
    chunked_layers: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()
    l2_qk_norm: bool = False
    attn_temperature: tuple[float, float] | None = None
    # Qwen3-Next (defaults: the others): q_proj also yields a gate per head (sigmoid, times the
    # attention output); the linear-attention layers (None: every layer is attention).
    attn_output_gate: bool = False
    linear_attention: GatedDeltaSpec | None = None
    mla: MlaSpec | None = None  # DeepSeek-V3: latent attention (num_kv_heads 1, head_dim the rope width)
    # Granite 4 (defaults: the others): Mamba-2 layers beside attention; each block's output times
    # residual_multiplier before it joins the residual; logits divided by logits_scaling.
    mamba: Mamba2Spec | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers that keep a per-sequence state instead of KV (a hybrid model's; () for the others)."""
        if self.linear_attention is not None:
            return self.linear_attention.layers
        return self.mamba.layers if self.mamba is not None else ()

    def layer_window(self, index: int) -> int | None:
        """Layer ``index``'s attention window (a query at ``p`` sees keys after ``p - W``), or None."""
        return self.sliding_window if index in self.sliding_layers else None

    def layer_rope_table(self, index: int) -> int:
        """Which rope table layer ``index`` rotates with: 1 for Gemma 3's local layers, else 0."""
        return 1 if self.local_rope and index in self.sliding_layers else 0


def shape_fields(config: Any) -> dict[str, Any]:
    """The fields every decoder's spec reads the same way: sizes, heads, norm epsilon, length."""
    num_heads = config.num_attention_heads
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_layers": config.num_hidden_layers,
        "num_heads": num_heads,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or num_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
    }


def sliding_layers_of(config: Any, window: int | None) -> tuple[int, ...]:
    """The layers whose attention is windowed, as transformers picks them: with ``layer_types``
    (Qwen2/Qwen3: ``sliding_attention`` from ``max_window_layers`` on, when
    ``use_sliding_window``), the ``sliding_attention`` ones; without (Mistral, Mixtral,
    Qwen3-MoE), every layer when a window is set."""
    if window is None:
        return ()
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens (got {window!r}).")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return tuple(range(config.num_hidden_layers))
    return tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
