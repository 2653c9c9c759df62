"""Tiny random Qwen3-Next checkpoints (``Qwen3NextForCausalLM``) made from transformers' own
``Qwen3NextConfig`` with the demo tokenizer: Gated DeltaNet and gated full-attention layers, expert
layers with a gated shared expert, zero-centred norms and partial rotary. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from inflight.runtime.demo.model import SIZES, train_tokenizer

TINY = SIZES["tiny"]
# hidden 128, 4 layers (linear, full, linear, full), 4 attention heads of 32 over 2 KV heads,
# linear layers with 2 key heads and 4 value heads of 32, a 4-tap conv; 4 experts (top 2) from
# layer 1 on, layer 0 dense.
SHAPE: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    shared_expert_intermediate_size=64,
    decoder_sparse_step=1,
    mlp_only_layers=[0],
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)


def make_qwen3_next(out_dir: Path, seed: int = 7, overrides: dict[str, Any] | None = None) -> Path:
    """Write a seeded random Qwen3-Next (``SHAPE`` with ``overrides``) and the demo tokenizer."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(TINY.vocab_size, "llama")
    config = transformers.Qwen3NextConfig(
        **{**SHAPE, **(overrides or {})},
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.08,
        architectures=["Qwen3NextForCausalLM"],
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # spread what starts constant, so the +1 of the norms and the decay matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("A_log"):  # slow decays: the recurrent state carries far
                param.copy_(torch.empty_like(param).uniform_(0.05, 0.6).log())
            elif name.endswith("dt_bias"):
                param.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
