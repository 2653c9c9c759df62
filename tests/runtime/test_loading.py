"""Checkpoint loading: sharded safetensors, reduced precision, missing or misfit weights."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.runtime import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["def fib(n):", "import os\nimport sys"]


def _copy_tokenizer(src, dst) -> None:
    for name in src.iterdir():
        if name.suffix != ".safetensors" and name.name != "model.safetensors.index.json":
            shutil.copy(name, dst / name.name)


def test_sharded_checkpoint_loads_identically(model_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    src = model_factory("mistral")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(src)).save_pretrained(str(sharded), max_shard_size="150KB")
    _copy_tokenizer(src, sharded)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    want = [o.token_ids for o in LLM(src, num_kv_blocks=32).generate(PROMPTS, GREEDY)]
    got = [o.token_ids for o in LLM(sharded, num_kv_blocks=32).generate(PROMPTS, GREEDY)]
    assert got == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_runs_and_mostly_agrees(llama_dir, dtype):
    llm = LLM(llama_dir, num_kv_blocks=32, dtype=dtype)
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    assert next(llm.engine.runner.model.parameters()).dtype == getattr(torch, dtype)
    ref = LLM(llama_dir, num_kv_blocks=32).generate(PROMPTS, GREEDY)
    out = llm.generate(PROMPTS, GREEDY)
    for o, r in zip(out, ref, strict=True):
        assert len(o.token_ids) == 12
        assert o.token_ids[:2] == r.token_ids[:2], "reduced precision diverged from the first tokens"


def test_missing_weight_is_named(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights: layers.1.mlp.down_proj.weight"):
        LLM(broken, num_kv_blocks=8)


def test_misshapen_weight_is_named(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.norm.weight: shape \(3,\)"):
        LLM(broken, num_kv_blocks=8)
