"""Gemma 3 text (``Gemma3ForCausalLM``) token-exact against transformers ``generate`` (float32, CPU).

The demo model alternates a local layer (16-token sliding window, rope base 10k) with a global
one (rope base 1M), with Gemma's (1 + weight) norms, sandwich norms, scaled and tied
embeddings, q/k norms, ``query_pre_attn_scalar`` and a GELU-tanh MLP. Prompts and generations
run well past the window; steps mix prefills and decodes, then chunked context, preemption and
prefix caching.
"""

from __future__ import annotations

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config

from .hf_reference import assert_engine_matches_hf, prompts_of_lengths

LENGTHS = [40, 3, 90, 9, 57, 16, 73, 1]
MAX_TOKENS = [24, 30, 12, 20, 16, 26, 10, 28]


@pytest.fixture(scope="module")
def gemma_dir(model_factory):
    return model_factory("gemma3", seed=5)


def _prompts(model_dir, lengths=LENGTHS):
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(device="cpu", dtype="float32", num_kv_blocks=8))
    return prompts_of_lengths(engine.tokenizer, lengths)


def test_spec_local_and_global_layers(gemma_dir):
    spec = spec_from_hf_config(load_hf_config(gemma_dir))
    assert spec.arch == "gemma3_text" and spec.sliding_window == 16
    assert spec.sliding_layers == (0,)
    assert [spec.layer_window(i) for i in range(2)] == [16, None]
    assert [spec.layer_rope_table(i) for i in range(2)] == [1, 0]
    assert spec.tie_word_embeddings and spec.qk_norm and spec.sandwich_norms


def test_mixed_steps(gemma_dir):
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=512)
    assert_engine_matches_hf(gemma_dir, config, _prompts(gemma_dir), MAX_TOKENS)


def test_chunked_context(gemma_dir):
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=13,
                          enable_chunked_context=True)
    assert_engine_matches_hf(gemma_dir, config, _prompts(gemma_dir), MAX_TOKENS)


def test_preemption(gemma_dir):
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=12, block_size=16,
                          max_num_tokens=256, enable_prefix_caching=False)
    engine = assert_engine_matches_hf(gemma_dir, config, _prompts(gemma_dir), MAX_TOKENS)
    assert engine.stats().num_preemptions > 0


def test_prefix_caching(gemma_dir):
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=256,
                          enable_prefix_caching=True)
    base = _prompts(gemma_dir, [50])[0]
    tails = _prompts(gemma_dir, [3, 20, 1, 14])
    prompts = [base + t[1:] for t in tails] + [base]
    engine = assert_engine_matches_hf(gemma_dir, config, prompts, [12, 14, 9, 16, 10])
    assert engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
     ("hidden_activation", "relu", "hidden_activation")],
)
def test_unsupported_gemma_options_are_refused(gemma_dir, field, value, said):
    config = load_hf_config(gemma_dir)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=said):
        spec_from_hf_config(config)
