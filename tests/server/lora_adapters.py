"""Test helper: PEFT LoRA adapters made locally for a model directory, written the way PEFT's
``save_pretrained`` writes them (``adapter_config.json`` + ``adapter_model.safetensors``), with
seeded random A and non-zero B, so that an adapter changes what the model generates. No ``peft``
needed; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _shapes(model_dir: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(num_layers, module -> (in_features, out_features)) of the model in ``model_dir``."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    q, kv = heads * head_dim, kv_heads * head_dim
    return config["num_hidden_layers"], {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def make_adapter(model_dir: Path, out_dir: Path, *, seed: int, rank: int = 8, alpha: float = 16.0,
                 targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj"), b_std: float = 0.2,
                 out_features_delta: int = 0) -> Path:
    """A PEFT LoRA adapter for the model in ``model_dir``, written to ``out_dir`` (returned).
    ``out_features_delta``: make every B that many rows off (a shape the model does not have)."""
    num_layers, shapes = _shapes(model_dir)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in targets:
            part = "self_attn" if module in ATTENTION else "mlp"
            in_f, out_f = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=generator) / in_f**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f + out_features_delta, rank, generator=generator) * b_std
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets), "use_rslora": False,
              "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out_dir
