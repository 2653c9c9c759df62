"""Async scheduling with tensor parallelism on the CPU (gloo): a TP=2 engine with async scheduling
and n-gram drafts or an EAGLE-3 head (a random one, on rank 0) gives the tokens of a synchronous
TP=1 engine without speculation (steps mixing prefills and decodes, chunked context, forced
preemption, prefix hits; pipelined and speculating steps both run), and a dead rank or a step
that fails half-way is a fatal engine error while a step is in flight, never a hang or a retry."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.llm import LLM
from inflight.runtime.outputs import EngineFatalError
from inflight.runtime.sampling_params import SamplingParams

from .hf_reference import prompts_of_lengths
from .parallel_pairs import CONFIG, LENGTHS, greedy, one_live, run_both, run_shared_scenario
from .test_speculative_eagle3 import make_head

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("when", ["busy", "idle"])
def test_a_killed_rank_is_fatal_with_a_step_in_flight(model_factory, when: str) -> None:
    with LLM(model_factory("llama"), tensor_parallel_size=2, num_kv_blocks=64, async_scheduling=True) as llm:
        engine = llm.engine
        assert engine.pipeline is not None
        procs = list(engine.runner.workers._procs.values())
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        for i in range(8):
            engine.add_request(str(i), [1, 5, 7, 9] * 10, params)
        for _ in range(3):
            engine.step()
        assert engine.pipeline.busy  # a step is in flight on the worker thread
        if when == "idle":
            for i in range(8):
                engine.abort_request(str(i))
            while engine.has_unfinished_requests():  # the step in flight is read (its rows thrown away)
                engine.step()
        os.kill(procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineFatalError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            while time.monotonic() - t0 < 60:  # patience only: the next step (busy) or the idle poll raises
                if engine.has_unfinished_requests():
                    engine.step()
                else:
                    time.sleep(0.01)
    assert all(p.poll() is not None for p in procs)


def test_a_step_that_fails_half_way_is_fatal_for_good(model_factory) -> None:
    """Rank 0 leaves a step on the worker thread half-way: the ranks are out of step, so the
    pipeline does not run it again (as it would a step that failed on one rank's own data)."""
    with LLM(model_factory("llama"), tensor_parallel_size=2, num_kv_blocks=32, async_scheduling=True) as llm:
        engine = llm.engine
        engine.add_request("a", [1, 5, 7, 9], SamplingParams(max_tokens=50, temperature=0.0))
        engine.step()
        forward = engine.runner._forward

        def failing(*args):
            engine.runner._forward = forward
            raise RuntimeError("boom")

        engine.runner._forward = failing
        with pytest.raises(EngineFatalError, match="step failed: boom"):
            for _ in range(3):
                engine.step()
        with pytest.raises(EngineFatalError, match="step failed: boom"):
            engine.step()
        assert engine.pipeline.num_drains == 0  # no synchronous retry of a broken group


class AsyncPair:
    """A synchronous TP=1 engine without speculation and an async TP=2 one that speculates
    (while fewer than 4 requests run, so the runs mix pipelined and speculating steps)."""

    def __init__(self, model_dir, spec: dict[str, object]) -> None:
        self.one = LLMEngine.from_model_dir(model_dir, EngineConfig(**CONFIG))
        self.llm = LLM(model_dir, tensor_parallel_size=2, async_scheduling=True,
                       speculative_config=json.dumps({**spec, "disable_by_batch_size": 4}), **CONFIG)  # fmt: skip
        self.two = self.llm.engine

    def run(self, prompts: list[list[int]], params: list[SamplingParams], **knobs) -> list[dict[str, list[int]]]:
        return run_both((self.one, self.two), prompts, params, **knobs)


@pytest.fixture(scope="module")
def pairs(model_factory, tmp_path_factory: pytest.TempPathFactory):
    """At most one live TP=2 engine (torch.distributed's group is per process)."""

    def make(method: str) -> AsyncPair:
        if method == "ngram":
            return AsyncPair(model_factory("llama"), NGRAM)
        root = tmp_path_factory.mktemp("tp-eagle3")
        target = make_demo_model(root / "target", "llama", config_overrides={"num_hidden_layers": 4})
        head = make_head(target, root / "head")
        return AsyncPair(target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})

    yield from one_live(make)


@pytest.mark.parametrize("scenario", ["mixed", "chunked", "preemption", "prefix"])
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_tp2_async_speculative_tokens_equal_tp1(pairs, method: str, scenario: str) -> None:
    pair = pairs(method)
    prompts = prompts_of_lengths(pair.two.tokenizer, LENGTHS)
    if scenario == "mixed":
        one, two = pair.run(prompts, greedy(len(prompts)))
    else:
        one, two = run_shared_scenario(pair, scenario, prompts)
    assert two == one
    stats, pipeline = pair.two.stats(), pair.two.pipeline
    # rank 0's worker proposes the drafts of requests in flight (the head's, or n-grams): pipelined
    assert pipeline is not None and stats.spec_num_drafts > 0 and pipeline.num_spec_pipelined > 0
