"""``max_tokens_in_paged_kv_cache`` (TensorRT-LLM's knob) caps the KV cache at that many
tokens, whatever the memory fraction or ``num_kv_blocks`` would give; the CLI and the CR
carry it, and the CR's ``speculativeConfig`` object becomes the ``--speculative-config`` flag."""

from __future__ import annotations

import json

import pytest

from inflight.operator import engine_args
from inflight.runtime.cli.command import build_parser, engine_config_from_args
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine


@pytest.mark.parametrize(("blocks", "cap", "expected"), [(100, 16 * 40, 40), (100, 16 * 400, 100), (100, 16 * 40 + 15, 40),
                                                         (None, 16 * 30, 30)])  # fmt: skip
def test_the_cap_takes_the_smaller(llama_dir, blocks: int | None, cap: int, expected: int) -> None:
    config = EngineConfig(device="cpu", num_kv_blocks=blocks, max_tokens_in_paged_kv_cache=cap, max_model_len=256)
    engine = LLMEngine.from_model_dir(llama_dir, config)
    assert engine.runner.num_kv_blocks == expected == engine.stats().num_kv_blocks


def test_a_cap_below_one_block_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tokens_in_paged_kv_cache must be an integer >= 16"):
        EngineConfig(max_tokens_in_paged_kv_cache=8)


def test_cli_and_cr_agree() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    values = engine_args.parse_engine({"maxTokensInPagedKvCache": 4096, "speculativeConfig": spec})
    flags = engine_args.static_flags(values)
    assert flags[flags.index("--max-tokens-in-paged-kv-cache") + 1] == "4096"
    assert json.loads(flags[flags.index("--speculative-config") + 1]) == spec
    args = build_parser().parse_args(["serve", "m", *flags])
    config = engine_config_from_args(args)
    assert config.max_tokens_in_paged_kv_cache == 4096 and json.loads(config.speculative_config) == spec
    with pytest.raises(ValueError, match="speculative"):
        engine_args.parse_engine({"speculativeConfig": {"method": "ngram", "num_speculative_tokens": 0}})
