"""LoRA test helpers: seeded PEFT adapters made locally with ``peft.get_peft_model`` on the test
models (B non-zero, so each adapter changes the tokens), and peft's greedy continuations, one
request at a time, as the reference."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir: Path, out_dir: Path, seed: int, r: int = 8, alpha: float = 16.0,
                 targets: list[str] | str | None = None, use_rslora: bool = False, scale: float = 0.3) -> Path:
    """A PEFT LoRA adapter of ``model_dir`` with seeded random A and B, saved to ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets if targets is not None else ALL_MODULES,
                        use_rslora=use_rslora, lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(out_dir)
    return out_dir


def edit_config(adapter_dir: Path, out_dir: Path, **changes) -> Path:
    """A copy of ``adapter_dir`` with ``adapter_config.json`` changed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    config.update(changes)
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    (out_dir / "adapter_model.safetensors").write_bytes((adapter_dir / "adapter_model.safetensors").read_bytes())
    return out_dir


@functools.lru_cache(maxsize=4)
def _base(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=16)
def _peft(model_dir: str, adapter_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


@functools.lru_cache(maxsize=1024)
def _greedy(model_dir: str, adapter_dir: str | None, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = _base(model_dir) if adapter_dir is None else _peft(model_dir, adapter_dir)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return tuple(out[0, len(prompt):].tolist())


def peft_greedy(model_dir: Path, adapter_dir: Path | None, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers (+ peft when ``adapter_dir``) greedy continuation, one request alone."""
    return list(_greedy(str(model_dir), None if adapter_dir is None else str(adapter_dir), tuple(prompt),
                        max_new_tokens))
