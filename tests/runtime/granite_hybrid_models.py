"""Tiny random Granite 4 hybrid checkpoints (``GraniteMoeHybridForCausalLM``) made from transformers'
own ``GraniteMoeHybridConfig`` with the demo tokenizer: Mamba-2 and attention layers, expert layers
beside the shared MLP (or the shared MLP alone), muP multipliers. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from inflight.runtime.demo.model import SIZES, train_tokenizer

TINY = SIZES["tiny"]
# hidden 64, 4 layers (mamba, attention, mamba, mamba) as Granite 4.0-H mixes them, NoPE
# attention (4 heads of 16 over 2 KV heads); Mamba-2 layers of 4 heads of 32 in 2 groups, a
# 16-wide state, a 4-tap conv with a bias, transformers' chunked scan in 16-token chunks (so its
# prefill crosses chunk boundaries); 4 experts (top 2) beside a 48-wide shared MLP.
SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=32,
    shared_intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["mamba", "attention", "mamba", "mamba"],
    mamba_n_heads=4,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_head=32,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    position_embedding_type="nope",
    embedding_multiplier=3.0,
    residual_multiplier=0.5,
    attention_multiplier=0.125,
    logits_scaling=2.5,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def make_granite_hybrid(out_dir: Path, seed: int = 11, overrides: dict[str, Any] | None = None) -> Path:
    """Write a seeded random Granite 4 hybrid (``SHAPE`` with ``overrides``) and the demo tokenizer."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(TINY.vocab_size, "llama")
    shape = {**SHAPE, **(overrides or {})}
    # transformers 5 names the layer kinds linear_attention / full_attention (config.json may say either)
    shape["layer_types"] = [{"mamba": "linear_attention", "attention": "full_attention"}.get(k, k)
                            for k in shape["layer_types"]]  # fmt: skip
    config = transformers.GraniteMoeHybridConfig(
        **shape,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.08,
        architectures=["GraniteMoeHybridForCausalLM"],
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # spread what starts constant, so the norms, decays, skips and biases matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("A_log"):  # slow decays: the state carries far
                param.copy_(torch.empty_like(param).uniform_(0.05, 0.6).log())
            elif name.endswith(("dt_bias", "conv1d.bias")):
                param.normal_(0.0, 0.5)
            elif name.endswith("mamba.D"):
                param.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
