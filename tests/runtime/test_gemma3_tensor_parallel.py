"""Gemma 3 under tensor parallelism on the CPU (gloo): TP=2 gives the same greedy tokens as
TP=1 (local and global layers, q/k norms replicated, scaled tied embeddings split by vocab),
with prompts past the sliding window, mixed steps and forced preemption."""

from __future__ import annotations

import pytest

from inflight.runtime.sampling_params import SamplingParams

from .hf_reference import prompts_of_lengths
from .parallel_pairs import LENGTHS, MAX_TOKENS
from .test_tensor_parallel import Pair


@pytest.fixture(scope="module")
def pair(model_factory):
    made = Pair(model_factory("gemma3", seed=5), 2)
    yield made
    made.llm.close()


@pytest.mark.parametrize(("scenario", "max_num_tokens", "per_step"),
                         [("mixed", 512, 3), ("chunked", 24, 3), ("preemption", 256, 16)])
def test_gemma3_tp2_matches_tp1(pair, scenario, max_num_tokens, per_step):
    prompts = prompts_of_lengths(pair.one.tokenizer, LENGTHS)
    params = [SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0) for i in range(len(prompts))]
    before = [e.stats().num_preemptions for e in (pair.one, pair.two)]
    one, two = pair.run(prompts, params, max_num_tokens=max_num_tokens, per_step=per_step)
    assert two == one, f"{scenario}: TP=2 tokens differ from TP=1"
    if scenario == "preemption":
        assert all(e.stats().num_preemptions > b for e, b in zip((pair.one, pair.two), before, strict=True))
