"""Tiny random checkpoints of the families served through the Llama decoder with a twist
(Phi-3/Phi-4, GLM-4.5, Llama 4 text, DeepSeek-V3, DeepSeek-V2), made from transformers' own config classes with the demo tokenizer.
Nothing is downloaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from inflight.runtime.demo.model import SIZES, train_tokenizer

TINY = SIZES["tiny"]


def _config(arch: str, vocab_size: int, ids: dict[str, Any], overrides: dict[str, Any]) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=TINY.hidden_size, intermediate_size=TINY.intermediate_size,
        num_hidden_layers=TINY.num_layers, num_attention_heads=TINY.num_heads,
        num_key_value_heads=TINY.num_kv_heads, max_position_embeddings=TINY.max_position_embeddings,
        rms_norm_eps=1e-5, initializer_range=TINY.init_std, tie_word_embeddings=False, **ids,
    )
    if arch == "phi3":
        return transformers.Phi3Config(**{**common, **overrides}, architectures=["Phi3ForCausalLM"])
    if arch == "glm4_moe":  # GLM-4.5's shape in small: a dense first layer, 8 experts in 4 groups
        glm = dict(
            num_hidden_layers=3, head_dim=2 * TINY.hidden_size // TINY.num_heads, attention_bias=True,
            n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=TINY.intermediate_size // 4,
            n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=2.5, use_qk_norm=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        )
        return transformers.Glm4MoeConfig(**{**common, **glm, **overrides}, architectures=["Glm4MoeForCausalLM"])
    if arch == "llama4_text":  # Llama 4's layer pattern in small: RoPE+chunked x3 then NoPE; experts every 2nd
        llama4 = dict(
            num_hidden_layers=4, head_dim=16, intermediate_size=TINY.intermediate_size // 2,
            intermediate_size_mlp=TINY.intermediate_size, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, attention_chunk_size=16, use_qk_norm=True, attn_temperature_tuning=True,
            floor_scale=4, attn_scale=0.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
        return transformers.Llama4TextConfig(**{**common, **llama4, **overrides}, architectures=["Llama4ForCausalLM"])
    if arch == "deepseek_v3":  # DeepSeek-V3's shape in small (tests/engine/test_deepseek_v3*.py)
        deepseek = dict(
            hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_key_value_heads=TINY.num_heads,
            q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, n_shared_experts=1, n_group=4,
            topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": TINY.max_position_embeddings // 8},
        )
        return transformers.DeepseekV3Config(**{**common, **deepseek, **overrides}, architectures=["DeepseekV3ForCausalLM"])
    if arch == "deepseek_v2":  # DeepSeek-V2's routing in small (tests/engine/test_deepseek_v2.py): 8 experts in 4 groups
        deepseek = dict(
            hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_key_value_heads=TINY.num_heads,
            q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, n_shared_experts=2, n_group=4,
            topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=1, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": TINY.max_position_embeddings // 8},
        )
        return transformers.DeepseekV2Config(**{**common, **deepseek, **overrides}, architectures=["DeepseekV2ForCausalLM"])
    raise ValueError(f"unknown family {arch!r}")


def make_family_model(out_dir: Path, arch: str, seed: int = 3, overrides: dict[str, Any] | None = None) -> Path:
    """Write a seeded random ``arch`` model (config overrides applied) with the demo tokenizer."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(TINY.vocab_size, "llama")
    ids = {"bos_token_id": tokenizer.bos_token_id, "pad_token_id": tokenizer.pad_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    config = _config(arch, len(tokenizer), ids, overrides or {})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases and the routing correction start at 0: spread them so they matter
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, TINY.init_std)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
    model.generation_config.eos_token_id = ids["eos_token_id"]
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


_TRITON_RUN = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams
from tests.runtime.hf_reference import run_staggered
prompts, max_tokens = json.loads(sys.argv[2])
config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64, kernel_backend="triton", max_num_tokens=24,
                      enable_chunked_context=True)
engine = LLMEngine.from_model_dir(sys.argv[1], config)
assert engine.runner.ops.paged_prefill_attention.__module__ == "inflight.kernels.triton_prefill_attention"
params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
tokens = run_staggered(engine, prompts, params)
print("TOKENS", json.dumps([tokens[str(i)] for i in range(len(prompts))]))
"""


def triton_tokens(model_dir: Path, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Greedy tokens of the engine on the Triton kernels, in Triton's interpreter on the CPU (24-token
    budget, chunked context), run in a process of its own: the variable must be set before the
    kernels are imported."""
    run = subprocess.run([sys.executable, "-c", _TRITON_RUN, str(model_dir), json.dumps([prompts, max_tokens])],
                         capture_output=True, text=True, check=False, cwd=Path(__file__).parents[2])  # fmt: skip
    if run.returncode != 0:
        raise AssertionError(f"the Triton run failed: {run.stderr[-3000:]}")
    return json.loads(next(line for line in run.stdout.splitlines() if line.startswith("TOKENS "))[7:])
