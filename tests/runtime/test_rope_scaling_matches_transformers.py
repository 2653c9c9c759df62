"""Scaled RoPE end to end: a demo llama whose config carries each scaled rope type (linear,
llama3, yarn), served by the engine and by transformers ``generate`` on the same weights
(float32, CPU), greedy token for token. ``test_rope_scaling.py`` compares the tables alone
(and stays in ``make test-fast``); this proves the model reads them, through config.json.

Prompts and generations run well past ``original_max_position_embeddings`` (64), so llama3's
and yarn's frequency bands all matter, and the same weights with unscaled rope must answer
differently (else the test could not catch a model silently running unscaled).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from inflight.runtime.config import EngineConfig
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.rope import rope_parameters

from .hf_reference import assert_engine_matches_hf, hf_greedy, prompts_of_lengths

ORIGINAL_MAX = 64
SCALED = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL_MAX},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": ORIGINAL_MAX},
}  # fmt: skip
LENGTHS, MAX_TOKENS = [3, 70, 130, 17], [24, 16, 12, 20]


def _llama(tmp_path_factory: pytest.TempPathFactory, rope: dict) -> Path:
    return make_demo_model(tmp_path_factory.mktemp(f"rope-{rope['rope_type']}"), "llama", seed=11,
                           config_overrides={"rope_parameters": dict(rope)})  # fmt: skip


@pytest.mark.parametrize("rope_type", sorted(SCALED))
def test_scaled_model_generates_what_transformers_does(tmp_path_factory, rope_type: str) -> None:
    model_dir = _llama(tmp_path_factory, SCALED[rope_type])
    assert rope_parameters(load_hf_config(model_dir))["rope_type"] == rope_type  # survived save and load
    prompts = prompts_of_lengths(AutoTokenizer.from_pretrained(model_dir), LENGTHS)
    config = EngineConfig(device="cpu", dtype="float32", num_kv_blocks=128, max_num_tokens=512)
    assert_engine_matches_hf(model_dir, config, prompts, MAX_TOKENS)

    plain = _llama(tmp_path_factory, {"rope_type": "default", "rope_theta": SCALED[rope_type]["rope_theta"]})
    unscaled = [hf_greedy(plain, p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    scaled = [hf_greedy(model_dir, p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    assert unscaled != scaled, "unscaled rope gave the same tokens: this test cannot tell them apart"
