"""Sliding-window models token-exact against transformers ``generate`` (float32, CPU), with
windows far shorter than the prompts and generations, so the window decides every output.

Mistral windows every layer; Qwen2 windows the layers from ``max_window_layers`` on (its
``layer_types``), so one model mixes windowed and full layers. Steps mix prefills and
decodes, then again with chunked context under a small token budget (chunks that start inside
and beyond the window), with preemption, and with prefix caching over a shared prefix.
"""

from __future__ import annotations

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config

from .hf_reference import assert_engine_matches_hf, prompts_of_lengths

WINDOW = 8
OVERRIDES = {
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1,
              "layer_types": ["full_attention", "sliding_attention"]},
}
LENGTHS = [40, 3, 90, 9, 57, 16, 73, 1]
MAX_TOKENS = [24, 30, 12, 20, 16, 26, 10, 28]  # every one past the window


@pytest.fixture(scope="module")
def windowed_model(tmp_path_factory):
    made = {}

    def make(arch: str):
        if arch not in made:
            made[arch] = make_demo_model(tmp_path_factory.mktemp(f"{arch}-sw"), arch, seed=5,
                                         config_overrides=OVERRIDES[arch])
        return made[arch]

    return make


def _prompts(model_dir, lengths=LENGTHS):
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=8))
    return prompts_of_lengths(engine.tokenizer, lengths)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_spec_reads_which_layers_are_windowed(windowed_model, arch):
    spec = spec_from_hf_config(load_hf_config(windowed_model(arch)))
    assert spec.sliding_window == WINDOW
    assert spec.sliding_layers == ((0, 1) if arch == "mistral" else (1,))
    assert spec.max_position_embeddings > WINDOW  # no longer capped at the window


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_mixed_steps_past_the_window(windowed_model, arch):
    model_dir = windowed_model(arch)
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=512)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir), MAX_TOKENS)
    assert engine.max_model_len > WINDOW


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_chunked_context_with_a_window(windowed_model, arch):
    model_dir = windowed_model(arch)
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=13,
                          enable_chunked_context=True)
    assert_engine_matches_hf(model_dir, config, _prompts(model_dir), MAX_TOKENS)


def test_preemption_with_a_window(windowed_model):
    model_dir = windowed_model("mistral")
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=12, block_size=16,
                          max_num_tokens=256, enable_prefix_caching=False)
    engine = assert_engine_matches_hf(model_dir, config, _prompts(model_dir), MAX_TOKENS)
    assert engine.stats().num_preemptions > 0


def test_prefix_caching_with_a_window(windowed_model):
    model_dir = windowed_model("qwen2")
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=256,
                          enable_prefix_caching=True)
    base = _prompts(model_dir, [50])[0]
    tails = _prompts(model_dir, [3, 20, 1, 14])
    prompts = [base + t[1:] for t in tails] + [base]
    engine = assert_engine_matches_hf(model_dir, config, prompts, [12, 14, 9, 16, 10])
    assert engine.stats().prefix_cache_hits > 0
