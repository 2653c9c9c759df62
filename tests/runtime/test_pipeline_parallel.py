"""Pipeline parallelism on the CPU with gloo (issue 54): PP=2 and TP=2 x PP=2 give TP=1's tokens.

Each engine is a real group of processes on 127.0.0.1 (rank 0 is this process, the other ranks
are workers), compared token for token with a TP=1 engine of the same config over the same
staggered requests: steps mixing prefills and decodes, chunked context under a small budget,
forced preemption under a small KV cache, prefix-cache hits, seeded sampling, a grammar, aborts
while steps are in flight, and the synchronous mode (one step in flight) beside the batch queue
(two). Each stage holds only its layers' weights and KV cache. What pipeline stages refuse is
refused before any process starts, naming the reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.llm import LLM
from inflight.runtime.model.stages import local_name, split_layers
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.structured.params import StructuredOutputsParams

from .hf_reference import prompts_of_lengths
from .parallel_pairs import CONFIG, LENGTHS, greedy, one_live, run_both, run_shared_scenario, run_with_aborts

SCENARIOS = ["mixed", "chunked", "preemption", "prefix", "seeded", "grammar", "abort", "one_in_flight"]


class Pair:
    """A TP=1 engine and a TP x PP engine of one model and config."""

    def __init__(self, model_dir: Path, tp: int, pp: int) -> None:
        self.one = LLMEngine.from_model_dir(model_dir, EngineConfig(**CONFIG))
        self.llm = LLM(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **CONFIG)
        self.two = self.llm.engine
        self.max_in_flight_seen = 0

    def run(self, prompts: list[list[int]], params: list[SamplingParams], **knobs) -> list[dict[str, list[int]]]:
        queue = self.two.pipeline
        launch = queue._launch

        def watched_launch(*args):  # how many steps the batch queue holds at once
            launched = launch(*args)
            self.max_in_flight_seen = max(self.max_in_flight_seen, queue.num_in_flight + 1)
            return launched

        queue._launch = watched_launch
        try:
            return run_both((self.one, self.two), prompts, params, **knobs)
        finally:
            del queue._launch


@pytest.fixture(scope="module")
def pairs(model_factory):
    """At most one live multi-rank engine (torch.distributed's group is per process)."""
    yield from one_live(lambda arch, tp, pp: Pair(model_factory(arch), tp, pp))


CASES = [("llama", 1, 2, s) for s in SCENARIOS] + [("llama", 2, 2, s) for s in SCENARIOS]
CASES += [("qwen3", 1, 2, s) for s in ("mixed", "preemption", "seeded")]


@pytest.mark.parametrize(("arch", "tp", "pp", "scenario"), CASES)
def test_pipeline_matches_tp1(pairs, arch: str, tp: int, pp: int, scenario: str) -> None:
    pair = pairs(arch, tp, pp)
    queue = pair.two.pipeline
    queue.max_in_flight = 1 if scenario == "one_in_flight" else pp
    prompts = prompts_of_lengths(pair.two.tokenizer, LENGTHS)
    pair.max_in_flight_seen = 0
    if scenario in ("mixed", "one_in_flight"):
        one, two = pair.run(prompts, greedy(len(prompts)))
        assert pair.max_in_flight_seen == queue.max_in_flight, "the batch queue never held that many steps"
        runner = pair.two.runner
        num_layers = runner.spec.num_layers
        assert len(runner.kv_caches) == len(runner.model.layers) == split_layers(num_layers, pp)[0].num_layers
        assert runner.model.norm is None and runner.model.lm_head is None, "stage 0 holds the last stage's parts"
        heads = [e.runner.model.layers[0].self_attn.num_heads for e in (pair.one, pair.two)]
        assert heads[1] == heads[0] // tp, "the stage's layers are not split by head"
    elif scenario == "grammar":
        spec = StructuredOutputsParams.regex(r"(ab|cd){2,5}x")
        params = [SamplingParams(max_tokens=16, temperature=0.8, seed=7 + i, structured=spec) for i in range(6)]
        one, two = pair.run(prompts[:6], params)
        text = [pair.two.tokenizer.decode(t) for t in two.values()]
        assert all(t.endswith("x") for t in text), text
    elif scenario == "abort":
        one, two = (run_with_aborts(e, prompts[:8], keep_aborted=False) for e in (pair.one, pair.two))
    else:
        shared = run_shared_scenario(pair, scenario, prompts)
        assert shared is not None, scenario
        one, two = shared
    assert two == one, f"{arch}/{scenario}: TP={tp} x PP={pp} tokens differ from TP=1"
    assert sum(len(t) for t in two.values()) > 0


def test_layers_split_contiguously_with_the_remainder_before_the_last_stage() -> None:
    assert [(s.start, s.end) for s in split_layers(5, 2)] == [(0, 3), (3, 5)]
    assert [(s.start, s.end) for s in split_layers(8, 3)] == [(0, 3), (3, 6), (6, 8)]
    assert [(s.start, s.end) for s in split_layers(4, 4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="exceeds the model's 2 decoder layers"):
        split_layers(2, 3)
    last = split_layers(4, 2)[1]
    assert local_name("layers.3.mlp.down_proj.weight", last, False) == "layers.1.mlp.down_proj.weight"
    assert local_name("layers.1.mlp.down_proj.weight", last, False) is None
    assert local_name("embed_tokens.weight", last, False) is None
    assert local_name("embed_tokens.weight", last, True) == "embed_tokens.weight"  # tied: the LM head's
    assert local_name("norm.weight", split_layers(4, 2)[0], False) is None


@pytest.mark.parametrize(("extra", "match"), [
    (dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'), "speculative_config: the drafter"),
    (dict(enable_lora=True), "enable_lora: LoRA adapters"),
    (dict(kv_offloading_size=1), "kv_offloading_size: the host tier"),
    (dict(scheduler_policy="fair"), "scheduler_policy fair"),
    (dict(async_scheduling=True), "async_scheduling"),
    (dict(device="sim"), "device sim"),
])
def test_what_pipeline_stages_refuse_is_refused_with_the_reason(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig(pipeline_parallel_size=2, **extra)


def test_more_stages_than_layers_fails_before_any_process(model_factory) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 decoder layers"):
        LLM(model_factory("llama"), pipeline_parallel_size=3, num_kv_blocks=8)


def test_a_failed_sampling_fails_that_steps_requests_and_the_engine_goes_on(pairs, monkeypatch) -> None:
    """Host-side failures cannot be retried request by request once a step is launched: the step's
    requests get an error, the other micro-batch's requests finish, no KV block leaks."""
    engine = pairs("llama", 1, 2).two
    engine.pipeline.max_in_flight = 2
    engine.update_config(max_num_tokens=2)  # two decodes a step: two micro-batches of the four requests
    sample = engine.sampler.sample
    calls = []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # a decode step, after both prompts' first tokens
            raise RuntimeError("injected sampling failure")
        return sample(*args, **kwargs)

    monkeypatch.setattr(engine.sampler, "sample", failing_once)
    for i in range(4):
        engine.add_request(f"f{i}", [1, 5, 7, 9][: i + 1], SamplingParams(max_tokens=6, temperature=0.0))
    reasons: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                reasons[out.req_id] = out.finish_reason
    engine.update_config(max_num_tokens=CONFIG["max_num_tokens"])
    assert len(reasons) == 4 and set(reasons.values()) == {"error", "length"}, reasons
    assert engine.stats().num_used_kv_blocks == 0
