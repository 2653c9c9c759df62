"""The checks every model family's "matches transformers" suite runs the same way, on a tiny random
model of the family (:func:`~.family_models.make_family_model`): greedy tokens equal to transformers
``generate`` under preemption and with prefix-cache hits, TP=2 equal to TP=1, and the Triton
kernels (in Triton's interpreter) equal to transformers. Knows nothing about any one family: a
suite passes its model directory and, where the family needs them, its prompt lengths, token
budgets and an extra look at the TP=2 engine.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine

from .family_models import make_family_model, triton_tokens
from .hf_reference import assert_engine_matches_hf, hf_greedy, prompts_of_lengths, run_staggered

LENGTHS = [1, 3, 7, 15, 16, 17, 31, 32, 33, 48, 5, 64, 2, 90, 24, 40]
MAX_TOKENS = [12, 20, 8, 16, 24, 10, 14, 18, 9, 22, 30, 11, 16, 13, 25, 17]


def family_models(
    tmp_path_factory: pytest.TempPathFactory, arch: str, models: dict[str, dict[str, Any]]
) -> Callable[[str], Path]:
    """A module fixture's value: ``get(name)`` writes the ``arch`` model with ``models[name]``'s
    config overrides once and returns its directory."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_family_model(tmp_path_factory.mktemp(name), arch, overrides=models[name])
        return made[name]

    return get


def cpu_config(**knobs) -> EngineConfig:
    return EngineConfig(device="cpu", dtype="float32", **knobs)


def prompts_for(model_dir: Path, lengths: list[int]) -> list[list[int]]:
    from transformers import AutoTokenizer

    return prompts_of_lengths(AutoTokenizer.from_pretrained(str(model_dir)), lengths)


def check_preemption(model_dir: Path, lengths: list[int] = LENGTHS, max_tokens: list[int] = MAX_TOKENS) -> None:
    """Transformers' tokens from a 12-block cache that forces preemption."""
    config = cpu_config(num_kv_blocks=12, block_size=16, max_num_tokens=256, enable_prefix_caching=False)
    engine = assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, lengths), max_tokens)
    assert engine.stats().num_preemptions > 0


def check_prefix_caching(model_dir: Path) -> None:
    """Transformers' tokens for prompts sharing a 50-token prefix, with prefix-cache hits."""
    config = cpu_config(num_kv_blocks=128, max_num_tokens=256, enable_prefix_caching=True)
    base = prompts_for(model_dir, [50])[0]
    prompts = [base + t[1:] for t in prompts_for(model_dir, [3, 9, 20, 1, 14, 30])] + [base]
    engine = assert_engine_matches_hf(model_dir, config, prompts, [10, 14, 8, 12, 16, 9, 11])
    assert engine.stats().prefix_cache_hits > 0


def check_tp2_matches_tp1(
    model_dir: Path,
    name: str,
    lengths: list[int] = LENGTHS,
    max_tokens: list[int] = MAX_TOKENS,
    inspect: Callable[[LLMEngine], None] | None = None,
) -> None:
    """The first ten staggered greedy requests give TP=1's tokens at TP=2 (chunked context under a
    48-token budget), leaking no KV block; ``inspect`` looks at the TP=2 engine before it closes."""
    from inflight.runtime.llm import LLM
    from inflight.runtime.sampling_params import SamplingParams

    knobs = dict(num_kv_blocks=64, block_size=16, max_num_tokens=48, enable_chunked_context=True)
    prompts = prompts_for(model_dir, lengths[:10])
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens[:10]]
    one = run_staggered(LLMEngine.from_model_dir(model_dir, EngineConfig(**knobs)), prompts, params)
    llm = LLM(model_dir, tensor_parallel_size=2, **knobs)
    try:
        two = run_staggered(llm.engine, prompts, params)
        assert llm.engine.stats().num_used_kv_blocks == 0, "KV blocks leaked"
        if inspect is not None:
            inspect(llm.engine)
    finally:
        llm.close()
    assert two == one, f"{name} TP=2 tokens differ from TP=1"


def check_triton_matches_hf(model_dir: Path, lengths: tuple[int, ...] = (17, 9, 5),
                            max_tokens: tuple[int, ...] = (8, 12, 14)) -> None:  # fmt: skip
    """The Triton kernels (Triton's interpreter on the CPU) give transformers' tokens too. By
    default: prompt chunks under the 24-token budget, decodes in a second KV block (17 + 8),
    decodes crossing a block boundary (9 + 12, 5 + 14) and steps where the last sequence
    decodes alone; no more steps than that (the interpreter runs each op as Python)."""
    prompts = prompts_for(model_dir, list(lengths))
    got = triton_tokens(model_dir, prompts, list(max_tokens))
    for i, prompt in enumerate(prompts):
        assert got[i] == hf_greedy(model_dir, prompt, max_tokens[i]), f"prompt {i} diverged"
