"""Greedy outputs token-identical to transformers ``generate`` on the same weights (float32).

The engine runs on the CPU and, on a GPU machine (``-m gpu``), on CUDA with the Triton
kernels and IEEE float32 matmuls; the reference is always transformers on the CPU.

Sixteen prompts of different lengths are added a few per step, so steps mix prefills and
decodes; then again with chunked context and a small token budget, with a KV cache small
enough to force preemption, and with prefix caching over prompts that share a prefix.
"""

from __future__ import annotations

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from tests.devices import on_devices

from .hf_reference import assert_engine_matches_hf, prompts_of_lengths

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
DEVICES = on_devices("cpu", "cuda")
LENGTHS = [1, 3, 7, 15, 16, 17, 31, 32, 33, 48, 5, 64, 2, 90, 24, 40]
MAX_TOKENS = [12, 20, 8, 16, 24, 10, 14, 18, 9, 22, 30, 11, 16, 13, 25, 17]


_check = assert_engine_matches_hf


def _config(device: str, **knobs) -> EngineConfig:
    return EngineConfig(device=device, dtype="float32", **knobs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_prefill_and_decode_steps(model_factory, arch, device):
    model_dir = model_factory(arch)
    config = _config(device, num_kv_blocks=256, max_num_tokens=512)
    engine = LLMEngine.from_model_dir(model_dir, config)
    prompts = prompts_of_lengths(engine.tokenizer, LENGTHS)
    _check(model_dir, config, prompts, MAX_TOKENS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_context_small_budget(model_factory, arch, device):
    model_dir = model_factory(arch)
    config = _config(device, num_kv_blocks=256, max_num_tokens=24, enable_chunked_context=True)
    engine = LLMEngine.from_model_dir(model_dir, config)
    prompts = prompts_of_lengths(engine.tokenizer, LENGTHS)
    _check(model_dir, config, prompts, MAX_TOKENS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_under_a_small_cache(model_factory, arch, device):
    model_dir = model_factory(arch)
    config = _config(device, num_kv_blocks=12, block_size=16, max_num_tokens=256, enable_prefix_caching=False)
    engine = LLMEngine.from_model_dir(model_dir, config)
    prompts = prompts_of_lengths(engine.tokenizer, LENGTHS)
    engine = _check(model_dir, config, prompts, MAX_TOKENS)
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_caching_shared_prefix(model_factory, arch, device):
    model_dir = model_factory(arch)
    config = _config(device, num_kv_blocks=128, max_num_tokens=256, enable_prefix_caching=True)
    engine = LLMEngine.from_model_dir(model_dir, config)
    base = prompts_of_lengths(engine.tokenizer, [50])[0]
    tails = prompts_of_lengths(engine.tokenizer, [3, 9, 20, 1, 14, 30, 6, 11])
    prompts = [base + t[1:] for t in tails] + [base]
    max_tokens = [10, 14, 8, 12, 16, 9, 11, 13, 10]
    engine = _check(model_dir, config, prompts, max_tokens)
    assert engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize(("arch", "fmt", "float_copy"), [
    ("llama", "mkl", "1"), ("llama", "mkl", "0"), ("llama", "onednn", "1"), ("llama", "onednn", "0"),
    ("qwen2", "mkl", "0"), ("qwen2", "onednn", "1"),
])  # fmt: skip
def test_few_row_products_with_and_without_the_float_copy(model_factory, arch, fmt, float_copy, monkeypatch):
    """Packed CPU weights in either format (MKL's, oneDNN's: the default off Intel CPUs), keeping
    their float copy (few-row steps on the few-row kernel, the default off Intel CPUs) or not,
    forced every way on any CPU."""
    monkeypatch.setenv("INFLIGHT_CPU_FLOAT_COPY", float_copy)
    monkeypatch.setenv("INFLIGHT_CPU_PACK_FORMAT", fmt)
    model_dir = model_factory(arch)
    config = _config("cpu", num_kv_blocks=256, max_num_tokens=512)
    engine = _check(model_dir, config, prompts_of_lengths(LLMEngine.from_model_dir(model_dir, config).tokenizer,
                                                          LENGTHS), MAX_TOKENS)
    weight = engine.runner.model.layers[0].self_attn.qkv_proj.weight
    assert (getattr(weight, "panels", None) is not None) == (float_copy == "1")  # unshared: its copy in panels
    assert getattr(weight, "fmt", None) == fmt
    # llama's and qwen2's demo models tie the head to the embedding: packed only over a float copy
    head = engine.runner.model.lm_head.weight
    assert (getattr(head, "float_rows", None) is not None) == (float_copy == "1")
    assert head is engine.runner.model.embed_tokens.weight or float_copy == "1"
