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
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.llm import LLM
from inflight.runtime.sampling_params import SamplingParams

from .hf_reference import prompts_of_lengths
from .parallel_pairs import CONFIG, LENGTHS, greedy, one_live, run_both, run_shared_scenario, run_with_aborts

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
SCENARIOS = ["mixed", "chunked", "preemption", "prefix", "seeded", "logprobs", "abort"]
LOGPROB_TOLERANCE = 1e-4  # fp32: o_proj/down_proj partial sums are added in another order


class Pair:
    """A TP=1 engine and a TP=N engine of one architecture and config."""

    def __init__(self, model_dir: Path, tp: int) -> None:
        self.model_dir = model_dir
        self.one = LLMEngine.from_model_dir(model_dir, EngineConfig(**CONFIG))
        self.llm = LLM(model_dir, tensor_parallel_size=tp, **CONFIG)
        self.two = self.llm.engine

    def run(self, prompts: list[list[int]], params: list[SamplingParams], **knobs) -> list[dict[str, list[int]]]:
        return run_both((self.one, self.two), prompts, params, **knobs)


@pytest.fixture(scope="module")
def pairs(model_factory):
    """At most one live TP>1 engine (torch.distributed's group is per process)."""
    yield from one_live(lambda arch, tp: Pair(model_factory(arch), tp))


# TP=4 on 2 KV heads: each KV head replicated on two ranks (qwen3: q/k norm, head_dim != hidden/heads).
CASES = [("qwen3", 4, s) for s in ("mixed", "preemption")] + [(a, 2, s) for a in ARCHS for s in SCENARIOS]
CASES += [(a, 2, s) for a in ("qwen3_moe", "mixtral") for s in ("mixed", "chunked", "preemption", "prefix")]


@pytest.mark.parametrize(("arch", "tp", "scenario"), CASES)
def test_tp_matches_tp1(pairs, arch: str, tp: int, scenario: str) -> None:
    pair = pairs(arch, tp)
    tok = pair.two.tokenizer
    prompts = prompts_of_lengths(tok, LENGTHS)
    if scenario == "mixed":
        one, two = pair.run(prompts, greedy(len(prompts)))
        sizes = [sum(p.numel() for p in e.runner.model.parameters()) for e in (pair.one, pair.two)]
        assert sizes[1] < 1.1 * sizes[0] / tp, f"rank 0 holds {sizes[1]} of {sizes[0]} parameters"
        kv_heads = pair.two.runner.spec.num_kv_heads
        assert pair.two.runner.kv_caches[0][0].shape[2] == max(1, kv_heads // tp), "KV cache not sharded by head"
    elif scenario == "abort":
        one, two = (run_with_aborts(e, prompts[:8], keep_aborted=True) for e in (pair.one, pair.two))
    elif scenario == "logprobs":
        one, two = _logprobs_within_tolerance(pair, prompts_of_lengths(tok, [7, 33, 64, 90]))
    else:
        shared = run_shared_scenario(pair, scenario, prompts)
        assert shared is not None, scenario
        one, two = shared
    assert two == one, f"{arch}/{scenario}: TP={tp} tokens differ from TP=1"
    assert sum(len(t) for t in two.values()) > 0


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
