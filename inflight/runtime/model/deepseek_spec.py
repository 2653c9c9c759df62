"""The ModelSpec of a DeepSeek-V3 config (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi K2 and kin).

Attention is multi-head latent attention (:class:`~.spec_types.MlaSpec`, run by :mod:`.mla`): the
spec's ``num_kv_heads`` is 1 (one latent shared by every head, replicated on every tensor-parallel
rank) and its ``head_dim`` is the rope width (``qk_rope_head_dim``, what transformers' config calls
``head_dim`` and what the rope table is built for). The attention scale is ``qk_head_dim ** -0.5``
times yarn's ``mscale(factor, mscale_all_dim) ** 2`` when the rope is scaled, as transformers
computes it. The expert layers (from ``first_k_dense_replace`` on) route as GLM-4.5's do (sigmoid
scores, group-limited top-k with the correction bias, a shared expert): the same :class:`MoeSpec`.
fp8 block-quantized checkpoints (DeepSeek's published weights: ``quant_method`` fp8 with
``weight_block_size``) are refused with the reason. Reads configs only.
"""

from __future__ import annotations

import math
from typing import Any

from inflight.runtime.model.family_specs import grouped_sigmoid_moe
from inflight.runtime.model.rope import rope_parameters
from inflight.runtime.model.spec_types import SUPPORTED_ROPE_TYPES, MlaSpec, ModelSpec, shape_fields


def deepseek_v3_spec(config: Any) -> ModelSpec:
    """The spec of a ``deepseek_v3`` config (``ValueError`` for what is not served)."""
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
        arch="deepseek_v3", **shape,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=False, sliding_window=None, hidden_act="silu",
        moe=grouped_sigmoid_moe(config), attn_scale=mla_scale(mla, rope), mla=mla,
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
