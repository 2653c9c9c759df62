"""Tensor parallelism on the CPU with gloo: TP=2 (and TP=4) give the same tokens as TP=1.

One TP=2 engine per architecture (through the offline ``LLM`` API: starting the worker
process costs seconds) is shared by the scenarios of that architecture, each compared token
for token with a TP=1 engine of the same config: steps mixing prefills and decodes, chunked
context under a small token budget, forced preemption under a small KV cache, prefix
caching, aborts mid-flight, seeded sampling, and logprobs (sampled and prompt), which bound the fp32 difference of the two
reduction orders. TP=4 on a model with 2 KV heads checks the replicated-KV-head layout (``INFLIGHT_TP_REPORT=1 pytest -s`` prints the measured worst case).
The mixture-of-experts families (each expert's intermediate dimension split like the MLP's) run
the greedy scenarios.
Supervision lives in ``test_tensor_parallel_supervision.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.llm import LLM
from inflight.runtime.sampling_params import SamplingParams

from .hf_reference import prompts_of_lengths, run_staggered

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
SCENARIOS = ["mixed", "chunked", "preemption", "prefix", "seeded", "logprobs", "abort"]
LENGTHS = [1, 3, 7, 15, 16, 17, 31, 32, 33, 48, 5, 64, 2, 90, 24, 40]
MAX_TOKENS = [12, 20, 8, 16, 24, 10, 14, 18, 9, 22, 30, 11, 16, 13, 25, 17]
# A cache of 14 blocks x 16 tokens: the staggered prompts do not all fit, so some are preempted.
CONFIG = dict(num_kv_blocks=14, block_size=16, max_num_tokens=512, enable_prefix_caching=True)
LOGPROB_TOLERANCE = 1e-4  # fp32: o_proj/down_proj partial sums are added in another order


class Pair:
    """A TP=1 engine and a TP=N engine of one architecture and config."""

    def __init__(self, model_dir: Path, tp: int) -> None:
        self.model_dir = model_dir
        self.one = LLMEngine.from_model_dir(model_dir, EngineConfig(**CONFIG))
        self.llm = LLM(model_dir, tensor_parallel_size=tp, **CONFIG)
        self.two = self.llm.engine

    def run(self, prompts: list[list[int]], params: list[SamplingParams], **knobs) -> list[dict[str, list[int]]]:
        results = []
        for engine in (self.one, self.two):
            engine.update_config(max_num_tokens=knobs.get("max_num_tokens", CONFIG["max_num_tokens"]))
            engine.pool.reset_prefix_cache()
            results.append(run_staggered(engine, prompts, params, knobs.get("per_step", 3)))
            stats = engine.stats()
            assert stats.num_running == stats.num_waiting == stats.num_used_kv_blocks == 0, "KV blocks leaked"
        return results


@pytest.fixture(scope="module")
def pairs(model_factory) -> Iterator[dict[str, Pair]]:
    """At most one live TP>1 engine (torch.distributed's group is per process)."""
    live: dict[tuple[str, int], Pair] = {}

    def get(arch: str, tp: int) -> Pair:
        if (arch, tp) not in live:
            for old in live.values():
                old.llm.close()
            live.clear()
            live[arch, tp] = Pair(model_factory(arch), tp)
        return live[arch, tp]

    yield get  # type: ignore[misc]
    for pair in live.values():
        pair.llm.close()


def _greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], temperature=0.0) for i in range(n)]


# TP=4 on 2 KV heads: each KV head replicated on two ranks (qwen3: q/k norm, head_dim != hidden/heads).
CASES = [("qwen3", 4, s) for s in ("mixed", "preemption")] + [(a, 2, s) for a in ARCHS for s in SCENARIOS]
CASES += [(a, 2, s) for a in ("qwen3_moe", "mixtral") for s in ("mixed", "chunked", "preemption", "prefix")]


@pytest.mark.parametrize(("arch", "tp", "scenario"), CASES)
def test_tp_matches_tp1(pairs, arch: str, tp: int, scenario: str) -> None:
    pair = pairs(arch, tp)
    tok = pair.two.tokenizer
    prompts = prompts_of_lengths(tok, LENGTHS)
    before = [e.stats() for e in (pair.one, pair.two)]
    if scenario == "mixed":
        one, two = pair.run(prompts, _greedy(len(prompts)))
        sizes = [sum(p.numel() for p in e.runner.model.parameters()) for e in (pair.one, pair.two)]
        assert sizes[1] < 1.1 * sizes[0] / tp, f"rank 0 holds {sizes[1]} of {sizes[0]} parameters"
        kv_heads = pair.two.runner.spec.num_kv_heads
        assert pair.two.runner.kv_caches[0][0].shape[2] == max(1, kv_heads // tp), "KV cache not sharded by head"
    elif scenario == "chunked":
        one, two = pair.run(prompts, _greedy(len(prompts)), max_num_tokens=24)
    elif scenario == "preemption":
        one, two = pair.run(prompts, _greedy(len(prompts)), max_num_tokens=256, per_step=16)
        for engine, b in zip((pair.one, pair.two), before, strict=True):
            assert engine.stats().num_preemptions > b.num_preemptions, "the small cache forced no preemption"
    elif scenario == "prefix":
        shared = prompts_of_lengths(tok, [49])[0]
        prefixed = [shared + p[1:] for p in prompts[:8]]
        one, two = pair.run(prefixed, _greedy(len(prefixed)), per_step=1)
        for engine, b in zip((pair.one, pair.two), before, strict=True):
            assert engine.stats().prefix_cache_hits > b.prefix_cache_hits, "no prefix-cache hit"
    elif scenario == "abort":
        one, two = (_run_with_aborts(e, prompts[:8]) for e in (pair.one, pair.two))
    elif scenario == "seeded":
        params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(8)]
        one, two = pair.run(prompts[:8], params)
    else:
        one, two = _logprobs_within_tolerance(pair, prompts_of_lengths(tok, [7, 33, 64, 90]))
    assert two == one, f"{arch}/{scenario}: TP={tp} tokens differ from TP=1"
    assert sum(len(t) for t in two.values()) > 0


def _run_with_aborts(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Abort every other request after four steps; the rest run to the end; no block leaks."""
    engine.pool.reset_prefix_cache()
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=20, temperature=0.0))
    for step in range(200):
        if step == 4:
            for i in range(1, len(prompts), 2):
                assert engine.abort_request(str(i)) is not None
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            break
    assert engine.stats().num_used_kv_blocks == 0, "KV blocks leaked"
    return tokens


def _prompt_logprobs(engine: LLMEngine, prompts: list[list[int]]) -> list[list]:
    """Prompt logprobs (prompts chunked by an 8-token budget) of each prompt, in order."""
    engine.update_config(max_num_tokens=8)
    got: dict[str, list] = {f"p{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.req_id].extend(out.prompt_logprobs or ())
    engine.update_config(max_num_tokens=CONFIG["max_num_tokens"])
    assert all(len(got[f"p{i}"]) == len(p) - 1 for i, p in enumerate(prompts))
    return list(got.values())


def _logprobs_within_tolerance(pair: Pair, prompts: list[list[int]]) -> tuple[dict, dict]:
    """The one place TP=2 may differ: fp32 sums in another order. Measured well below 1e-4."""
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    got = pair.llm.generate(prompts, params)
    want = LLM.from_engine(pair.one).generate(prompts, params)  # the offline API over the TP=1 engine
    worst = 0.0
    for g_out, w_out in zip(got, want, strict=True):
        for g, w in zip(g_out.logprobs or [], w_out.logprobs or [], strict=True):
            assert [t for t, _ in g.top] == [t for t, _ in w.top], "top-5 alternatives differ"
            worst = max(worst, abs(g.logprob - w.logprob), *(abs(a - b) for (_, a), (_, b) in zip(g.top, w.top, strict=True)))
    for prompt_one, prompt_two in zip(*(_prompt_logprobs(e, prompts) for e in (pair.one, pair.two)), strict=True):
        assert [t.token_id for t in prompt_one] == [t.token_id for t in prompt_two]
        worst = max(worst, *(abs(a.logprob - b.logprob) for a, b in zip(prompt_one, prompt_two, strict=True)))
    assert worst < LOGPROB_TOLERANCE, f"logprobs differ by {worst:.2e}"
    if os.environ.get("INFLIGHT_TP_REPORT"):
        print(f"\n{pair.model_dir.name}: worst logprob difference TP=2 vs TP=1: {worst:.3e}")
    return ({str(i): o.token_ids for i, o in enumerate(want)}, {str(i): o.token_ids for i, o in enumerate(got)})
