"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): greedy outputs token-identical to transformers ``generate``
(float32, CPU) on tiny random models from transformers' own ``Phi3Config``.

Three shapes: Phi-4 (14B)'s (default rope, no window), Phi-4-mini's (rotary over 3/4 of each head,
LongRoPE with an original length of 32: sequences within it are token-exact; the table's long
part equals transformers' long rotation, but a sequence crossing the original length is not
compared, see rope.py) and Phi-3's sliding window (8 tokens, every layer). The checkpoints hold ``qkv_proj`` and
``gate_up_proj`` fused, as Phi's do. Mixed prefill/decode steps, chunked context under a small token
budget, preemption under a small cache, prefix caching, and TP=2 (each rank's rows cut out of the
fused tensors) equal to TP=1.
"""

from __future__ import annotations

import pytest
import torch

from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.rope import build_rope_tables
from inflight.runtime.model.spec import spec_from_hf_config

from .family_checks import (
    LENGTHS,
    MAX_TOKENS,
    check_preemption,
    check_prefix_caching,
    check_tp2_matches_tp1,
    check_triton_matches_hf,
    cpu_config,
    family_models,
    prompts_for,
)
from .hf_reference import assert_engine_matches_hf

ORIGINAL = 32  # Phi-4-mini's LongRoPE switch point, scaled down
ROTARY = 12  # 3/4 of head_dim 16
MODELS = {
    "phi4": {},
    "phi4_mini": {
        "original_max_position_embeddings": ORIGINAL,
        "rope_parameters": {
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": ORIGINAL,
            "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0], "long_factor": [1.0, 1.5, 2.5, 4.0, 7.0, 12.0],
        },
    },
    "phi3_window": {"sliding_window": 8},
}
# LongRoPE equals transformers while the sequence stays within the original length (rope.py says
# why): prompt plus generation at most ORIGINAL tokens
SHORT_LENGTHS = [1, 3, 7, 15, 16, 17, 20, 12, 5, 2, 24, 12, 9, 27, 20, 10]


@pytest.fixture(scope="module")
def phi_models(tmp_path_factory: pytest.TempPathFactory):
    return family_models(tmp_path_factory, "phi3", MODELS)


def _lengths(name: str) -> list[int]:
    return SHORT_LENGTHS if name == "phi4_mini" else LENGTHS


def _max_tokens(name: str) -> list[int]:
    if name != "phi4_mini":
        return MAX_TOKENS
    return [min(m, ORIGINAL - n) for m, n in zip(MAX_TOKENS, SHORT_LENGTHS, strict=True)]


def test_spec_reads_the_phi3_configs(phi_models) -> None:
    plain = spec_from_hf_config(load_hf_config(phi_models("phi4")))
    assert plain.arch == "phi3" and plain.rotary_dim is None and plain.sliding_window is None
    assert not (plain.qkv_bias or plain.o_bias or plain.qk_norm)
    mini = spec_from_hf_config(load_hf_config(phi_models("phi4_mini")))
    assert mini.rotary_dim == ROTARY
    window = spec_from_hf_config(load_hf_config(phi_models("phi3_window")))
    assert window.sliding_window == 8 and window.sliding_layers == (0, 1)


def test_longrope_table_switches_to_the_long_factors_at_the_original_length(phi_models) -> None:
    """Below the original length the table is transformers' short-factor rotation, from it on the
    long one (as transformers' rotary module gives for a pass whose last position is there)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = load_hf_config(phi_models("phi4_mini"))
    table = build_rope_tables(config, spec_from_hf_config(config), 64)[0]  # [64, ROTARY]
    assert table.shape == (64, ROTARY)
    rotary = Phi3RotaryEmbedding(config)
    x = torch.zeros(1)
    for last in (ORIGINAL - 1, ORIGINAL, 63):  # a pass ending at position `last`
        cos, sin = rotary(x, torch.arange(last + 1)[None])
        half = ROTARY // 2
        torch.testing.assert_close(table[last, :half], cos[0, last, :half], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(table[last, half:], sin[0, last, :half], atol=1e-6, rtol=1e-6)


def test_unsupported_rope_is_refused(phi_models) -> None:
    config = load_hf_config(phi_models("phi4"))
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="unsupported Phi-3 rope type 'dynamic'"):
        spec_from_hf_config(config)


@pytest.mark.parametrize("name", list(MODELS))
def test_mixed_prefill_and_decode_steps(phi_models, name: str) -> None:
    model_dir = phi_models(name)
    config = cpu_config(num_kv_blocks=256, max_num_tokens=512)
    assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, _lengths(name)), _max_tokens(name))


@pytest.mark.parametrize("name", list(MODELS))
def test_chunked_context_small_budget(phi_models, name: str) -> None:
    model_dir = phi_models(name)
    config = cpu_config(num_kv_blocks=256, max_num_tokens=13, enable_chunked_context=True)
    assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, _lengths(name)), _max_tokens(name))


def test_preemption_under_a_small_cache(phi_models) -> None:
    check_preemption(phi_models("phi4"))


@pytest.mark.parametrize("name", ["phi4", "phi3_window"])
def test_prefix_caching_shared_prefix(phi_models, name: str) -> None:
    check_prefix_caching(phi_models(name))


@pytest.mark.parametrize("name", ["phi4", "phi4_mini"])
def test_tensor_parallel_2_matches_1(phi_models, name: str) -> None:
    check_tp2_matches_tp1(phi_models(name), name, _lengths(name), _max_tokens(name))


def test_triton_kernels_in_the_interpreter(phi_models) -> None:
    """The Triton kernels (Triton's interpreter on the CPU) give transformers' tokens too."""
    check_triton_matches_hf(phi_models("phi4_mini"))
