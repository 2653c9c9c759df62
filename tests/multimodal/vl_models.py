"""A tiny random Qwen2.5-VL checkpoint made from transformers' own config, with the demo tokenizer
plus Qwen's vision tokens, and images to show it. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from inflight.runtime.demo.model import SIZES, train_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TINY = SIZES["tiny"]
MAX_IMAGE_TOKENS = 16


def make_qwen2_5_vl_model(out_dir: Path, seed: int = 5) -> Path:
    """Write a seeded random Qwen2.5-VL (2 decoder layers, a 3-block vision tower with windows of
    2x2 merged patches and one full-attention block) and its tokenizer to ``out_dir``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(TINY.vocab_size, None)
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), VISION_TOKENS,
        strict=True)}  # fmt: skip
    text = dict(vocab_size=len(tokenizer), hidden_size=TINY.hidden_size, intermediate_size=TINY.intermediate_size,
                num_hidden_layers=2, num_attention_heads=TINY.num_heads, num_key_value_heads=TINY.num_kv_heads,
                max_position_embeddings=TINY.max_position_embeddings, rms_norm_eps=1e-5,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TINY.hidden_size,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                  fullatt_block_indexes=[1])  # fmt: skip
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                              architectures=["Qwen2_5_VLForConditionalGeneration"], **ids)  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # spread what starts at 0 or 1 so it matters
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("norm.weight") or name.endswith("ln_q.weight") or ".norm" in name:
                param.normal_(1.0, 0.1)
            elif name.startswith("model.visual.") and name.endswith("attn.qkv.weight"):
                param.normal_(0.0, 0.25)  # peaked attention, so each patch's position (its rotary) shows
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 28 * 28,
        "max_pixels": 28 * 28 * MAX_IMAGE_TOKENS, "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
    }))  # fmt: skip
    return out_dir


def random_image(width: int, height: int, seed: int) -> Image.Image:
    """A noisy RGB image with a smooth gradient in it (so resizing matters)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], axis=-1)
    noise = rng.integers(-40, 40, (height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
