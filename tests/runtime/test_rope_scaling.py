"""Our rotary tables equal transformers' for every rope type we accept (default, linear,
llama3, yarn): cos and sin at every position, attention scaling included. The engine tests
against transformers cover llama3 end to end (the demo llama uses it), and
``test_rope_scaling_matches_transformers.py`` runs linear, llama3 and yarn models end to end."""

from __future__ import annotations

import pytest
import torch
import transformers

from inflight.runtime.model.rope import build_cos_sin_cache, rope_parameters
from inflight.runtime.model.spec import SUPPORTED_ROPE_TYPES

HEAD_DIM, MAX_POS = 64, 4096
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024},
}  # fmt: skip


def test_every_supported_rope_type_is_covered() -> None:
    assert set(ROPES) == set(SUPPORTED_ROPE_TYPES)


@pytest.mark.parametrize("rope_type", sorted(ROPES))
def test_tables_match_transformers(rope_type: str) -> None:
    config = transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=MAX_POS,
                                      rope_parameters=dict(ROPES[rope_type]))  # fmt: skip
    assert rope_parameters(config)["rope_type"] == rope_type
    ours = build_cos_sin_cache(config, HEAD_DIM, MAX_POS)  # [pos, head_dim]: cos half, then sin half
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config=config)
    positions = torch.arange(MAX_POS)[None, :]
    cos, sin = rotary(torch.zeros(1, MAX_POS, HEAD_DIM), positions)  # [1, pos, head_dim], halves repeated
    half = HEAD_DIM // 2
    torch.testing.assert_close(ours[:, :half], cos[0, :, :half].float(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ours[:, half:], sin[0, :, :half].float(), atol=2e-5, rtol=2e-5)


def test_a_config_without_rope_parameters_is_refused() -> None:
    class Old:  # what transformers 4.x would hand us
        rope_scaling = {"type": "linear", "factor": 4.0}

    with pytest.raises(ValueError, match="transformers >= 5"):
        rope_parameters(Old())

