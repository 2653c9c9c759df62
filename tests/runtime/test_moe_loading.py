"""Loading mixture-of-experts checkpoints: both expert layouts, missing experts, refusals.

transformers 5 holds experts fused in memory (``experts.gate_up_proj`` ``[E, 2I, H]``,
``experts.down_proj`` ``[E, H, I]``) but ``save_pretrained`` writes them per expert, as the
Hub's checkpoints are (Qwen3-MoE ``experts.{e}.gate_proj``, Mixtral
``block_sparse_moe.experts.{e}.w1``); both load to the same model. MoE families we do not
serve (Qwen2-MoE) are refused at load, naming what is supported (DeepSeek-V3 is served:
tests/engine/test_deepseek_v3.py).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.model.layout import shard_layout
from inflight.runtime.model.loader import load_hf_config, load_model
from inflight.runtime.model.spec import spec_from_hf_config

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["def fib(n):", "import os\nimport sys", "class Node:"]


def _copy_all_but_weights(src: Path, dst: Path) -> None:
    dst.mkdir()
    for name in src.iterdir():
        if name.suffix != ".safetensors" and name.name != "model.safetensors.index.json":
            shutil.copy(name, dst / name.name)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fused_expert_layout_loads_identically(model_factory, tmp_path, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    src = model_factory(arch)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        assert any(".experts.0." in name for name in f.keys()), "save_pretrained wrote per-expert names"  # noqa: SIM118
    fused = tmp_path / "fused"
    _copy_all_but_weights(src, fused)
    state = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(fused / "model.safetensors"), metadata={"format": "pt"})
    want = [o.token_ids for o in LLM(src, num_kv_blocks=32, device="cpu", dtype="float32").generate(PROMPTS, GREEDY)]
    got = [o.token_ids for o in LLM(fused, num_kv_blocks=32, device="cpu", dtype="float32").generate(PROMPTS, GREEDY)]
    assert got == want


def test_missing_expert_is_named(model_factory, tmp_path) -> None:
    src = model_factory("mixtral")
    broken = tmp_path / "broken"
    _copy_all_but_weights(src, broken)
    weights = load_file(str(src / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights: layers.1.mlp.experts.gate_up_proj \(expert 5 up\)"):
        load_model(broken, torch.float32, torch.device("cpu"))


def test_misshapen_expert_is_named(model_factory, tmp_path) -> None:
    src = model_factory("qwen3_moe")
    broken = tmp_path / "broken"
    _copy_all_but_weights(src, broken)
    weights = load_file(str(src / "model.safetensors"))
    weights["model.layers.1.mlp.experts.2.down_proj.weight"] = torch.ones(3, 4)
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts.2.down_proj.weight: shape \(3, 4\)"):
        load_model(broken, torch.float32, torch.device("cpu"))


def _qwen2_moe():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(num_hidden_layers=2, architectures=["Qwen2MoeForCausalLM"])


@pytest.mark.parametrize("make_config", [_qwen2_moe], ids=["qwen2-moe"])
def test_unsupported_moe_family_is_refused_at_load(tmp_path, make_config) -> None:
    make_config().save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="unsupported architecture") as err:
        load_model(tmp_path, torch.float32, torch.device("cpu"))
    for supported in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM"):
        assert supported in str(err.value)


def test_tensor_parallel_must_split_the_experts(model_factory) -> None:
    spec = spec_from_hf_config(load_hf_config(model_factory("qwen3_moe")))
    assert spec.moe is not None and spec.moe.intermediate_size == 32
    assert shard_layout(spec, 1, 2).intermediate_size == spec.intermediate_size // 2
    odd = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate_size=34))
    with pytest.raises(ValueError, match=r"expert MLP width 34; sizes this model supports: 1, 2\.$"):
        shard_layout(odd, 0, 4)
