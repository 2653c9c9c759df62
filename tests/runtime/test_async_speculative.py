"""Speculative decoding under async scheduling (inflight.runtime.core.async_steps): greedy tokens
equal to the synchronous engine without speculation for n-gram, draft-model and EAGLE-3 (a random
head) drafters, in runs that mix pipelined steps and speculating ones, with chunked prompts,
preemption, prefix hits, stop strings and tokens, max_tokens ending a request mid-draft and an
abort; seeded sampling equal to the synchronous speculative engine; no leaked blocks; a draft
model's KV valid in the prefix cache after pipelined steps; and no drain at all once the batch is
too large to speculate. A model drafter's greedy requests speculate in pipelined steps
(core/spec_pipeline.py): the same drafts as the synchronous engine where every draft is kept, and
tokens unchanged where drafts are rejected."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.async_steps import StepPipeline
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.sampling_params import SamplingParams
from tests.runtime.test_async_scheduling import fail_forward_of
from tests.runtime.test_speculative import CASE_KNOBS, _engine, _requests, _run
from tests.runtime.test_speculative_draft import _assert_draft_kv_matches, perturbed_copy
from tests.runtime.test_speculative_eagle3 import make_head

METHODS = ("ngram", "draft_model", "eagle3")


@pytest.fixture(scope="module")
def models(model_factory, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("async-spec")
    target = model_factory("llama")
    deep = make_demo_model(root / "deep", "llama", config_overrides={"num_hidden_layers": 4})  # the head's aux layers
    return {"target": target, "draft": perturbed_copy(target, root / "perturbed", 0.1), "deep": deep,
            "head": make_head(deep, root / "head")}  # fmt: skip


def _spec(models: dict[str, Path], method: str, disable: int = 4, k: int = 3) -> tuple[Path, str]:
    """The target and the speculative config of ``method``; ``disable``: the batch size from
    which no step speculates (with 8 requests, the run's first steps are pipelined)."""
    spec: dict[str, object] = {"method": method, "num_speculative_tokens": k, "disable_by_batch_size": disable}
    if method == "ngram":
        spec.update(prompt_lookup_max=3, prompt_lookup_min=1)
    elif method == "draft_model":
        spec["model"] = str(models["draft"])
    else:
        spec["model"] = str(models["head"])
    return models["deep" if method == "eagle3" else "target"], json.dumps(spec)


def _counted(engine: LLMEngine) -> dict[str, int]:
    """Count the steps the pipeline launches (pipelined) beside the ones it drains."""
    pipeline = engine.pipeline
    assert isinstance(pipeline, StepPipeline)
    counts = {"launched": 0}
    launch = pipeline._launch

    def spy(*args):
        counts["launched"] += 1
        return launch(*args)

    pipeline._launch = spy  # type: ignore[method-assign]
    return counts


_baselines: dict[tuple[str, str], dict[str, tuple]] = {}


def _baseline(target: Path, case: str, requests) -> dict[str, tuple]:
    """The synchronous engine without speculation (made once per target and case)."""
    key = (str(target), case)
    if key not in _baselines:
        _baselines[key] = _run(_engine(target, None, **CASE_KNOBS.get(case, {})), requests)
    return _baselines[key]


@pytest.mark.parametrize("case", ["mixed", *CASE_KNOBS])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_equal_the_synchronous_engine_without_speculation(models, method: str, case: str,
                                                                        caplog) -> None:  # fmt: skip
    target, spec = _spec(models, method)
    requests = _requests(1000)
    engine = _engine(target, spec, async_scheduling=True, **CASE_KNOBS.get(case, {}))
    counts = _counted(engine)
    got = _run(engine, requests)  # no leaked blocks (checked there)
    assert got == _baseline(target, case, requests)
    if case == "prefix-cache":  # again: every prompt now hits the blocks of the first run
        assert _run(engine, requests) == got
    stats, pipeline = engine.stats(), engine.pipeline
    assert stats.spec_num_drafts > 0 and sum(stats.spec_accepted_per_position) == stats.spec_num_accepted_tokens
    assert counts["launched"] > 0
    # the drafts of a request whose last token is a placeholder are proposed on the worker: every
    # speculating step is pipelined (core/spec_pipeline.py), none drains
    assert pipeline.num_spec_pipelined > 0 and pipeline.num_drains == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no step failed and ran again
    if case == "preemption":
        assert stats.num_preemptions > 0
    if case == "prefix-cache":
        assert stats.prefix_cache_hits > 0
    engine.close()


@pytest.mark.parametrize("method", METHODS)
def test_stops_max_tokens_mid_draft_and_grammars(models, method: str) -> None:
    from inflight.runtime.structured import StructuredOutputsParams

    target, spec = _spec(models, method, disable=64, k=4)
    base = _requests(1000)[:3]
    free = _baseline(target, "mixed", _requests(1000))
    stop = free["1"][0][3:6]  # a string the greedy text reaches: it ends the request there
    stop_id = free["2"][1][5]  # a token it reaches: likewise, even when it is a kept draft
    schema = StructuredOutputsParams.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    requests = [
        (base[0][0], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)),  # ends inside a draft run
        (base[1][0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])),
        (base[2][0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id])),
        (base[2][0], SamplingParams(max_tokens=30, temperature=0.0)),  # may stop at EOS
        (base[0][0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)),
        (base[1][0], SamplingParams(max_tokens=12, temperature=0.0, structured=schema)),
    ]
    off = _run(_engine(target, None), requests)
    engine = _engine(target, spec, async_scheduling=True)
    on = _run(engine, requests)
    assert on == off
    assert len(on["0"][1]) == 7 and on["0"][2] == "length" and len(on["4"][1]) == 2
    assert on["1"][2] == "stop" and stop not in on["1"][0]
    assert on["2"][2] == "stop" and on["2"][1][-1] == stop_id
    assert engine.stats().spec_num_drafts > 0
    engine.close()


def _seeded(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    params = [SamplingParams(max_tokens=22, temperature=0.8, top_p=0.9, top_k=40, seed=s, ignore_eos=True)
              for s in (1, 2, 3)]  # fmt: skip
    params.append(SamplingParams(max_tokens=18, temperature=1.0, seed=9, frequency_penalty=0.5, logprobs=2))
    return [(prompt, p) for (prompt, _), p in zip(_requests(vocab), params, strict=False)]


@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_equals_the_synchronous_speculative_engine(models, method: str) -> None:
    """Below the batch-size cut-off every step speculates on both sides, so each request draws
    the same random numbers in the same order: the same tokens."""
    target, spec = _spec(models, method, disable=64)
    requests = _seeded(1000)
    sync = _engine(target, spec, async_scheduling=False)
    expected = _run(sync, requests)
    engine = _engine(target, spec, async_scheduling=True)
    got = _run(engine, requests)
    assert got == expected
    assert _spec_counts(engine) == _spec_counts(sync) and _spec_counts(sync)[0] > 0
    assert len({tokens for _, tokens, _ in got.values()}) == len(requests)
    assert engine.pipeline.num_spec_pipelined > 0  # the penalized request drains while it runs, not the others
    engine.close()


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_an_abort_between_speculating_steps(models, method: str) -> None:
    target, spec = _spec(models, method, disable=64)
    prompts = _requests(1000)
    runs = {}
    for flag in (False, True):
        engine = _engine(target, spec, async_scheduling=flag)
        engine.add_request("keep", prompts[2][0], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        engine.add_request("drop", prompts[3][0], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        seen: dict[str, list[int]] = {}
        for _ in range(4):
            for out in engine.step():
                seen.setdefault(out.req_id, []).extend(out.new_token_ids)
        engine.abort_request("drop")
        for _ in range(100):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                seen.setdefault(out.req_id, []).extend(out.new_token_ids)
        assert engine.stats().num_used_kv_blocks == 0 and engine.stats().spec_num_drafts > 0
        runs[flag] = seen
        engine.close()
    assert runs[True]["keep"] == runs[False]["keep"] and len(runs[True]["keep"]) == 16
    assert len(runs[True]["drop"]) < 16


@pytest.mark.parametrize("method", METHODS)
def test_a_request_not_in_flight_drafts_beside_ones_that_are(models, method: str, monkeypatch, caplog) -> None:
    """A budget too small for every decode leaves requests out of the step in flight; with the
    wait before scheduling switched off, the steps run through the speculating path, the drafts of
    those not in flight proposed on the host and the others' on the worker: tokens still equal
    the synchronous engine's without speculation."""
    target, spec = _spec(models, method, disable=64)
    requests = _requests(1000)
    engine = _engine(target, spec, async_scheduling=True, max_num_tokens=6)
    monkeypatch.setattr(engine.pipeline, "_waits_for_speculation", lambda: False)
    assert _run(engine, requests) == _run(_engine(target, None, max_num_tokens=6), requests)
    pipeline = engine.pipeline
    assert engine.stats().spec_num_drafts > 0
    assert pipeline.num_spec_pipelined > 0
    assert engine.pipeline.num_spec_waits == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no step failed and ran again
    engine.close()


def test_no_step_waits_once_the_batch_is_too_large_to_speculate(models) -> None:
    """From ``disable_by_batch_size`` running requests on no step speculates, and the pipeline
    runs as without speculation: no drain, no wait (the plain decode case has no extra sync)."""
    target, spec = _spec(models, "draft_model", disable=1)
    requests = _requests(1000)
    engine = _engine(target, spec, async_scheduling=True)
    assert _run(engine, requests) == _baseline(target, "mixed", requests)
    assert engine.stats().spec_num_drafts == 0
    assert engine.pipeline.num_drains == 0 and engine.pipeline.num_spec_waits == 0
    engine.close()


def test_the_draft_kv_of_pipelined_steps_is_valid_in_the_prefix_cache(models) -> None:
    """The target as its own draft: the draft model runs over every pipelined step on the worker,
    so every block the prefix cache holds has the draft's KV equal to the target's, and a follow-up
    turn that reuses a finished answer keeps ~every draft."""
    target = models["target"]
    spec = json.dumps({"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
                       "disable_by_batch_size": 3})  # fmt: skip
    engine = _engine(target, spec, async_scheduling=True, enable_prefix_caching=True, max_num_tokens=40)
    pattern = [(11 * j + 5) % 990 + 5 for j in range(23)]
    prompts = [(pattern * 4)[: 17 + 5 * i] for i in range(8)]
    requests = [(p, SamplingParams(max_tokens=9 + 3 * i, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts)]  # fmt: skip
    answers = _run(engine, requests)
    assert _assert_draft_kv_matches(engine) > 200  # nothing runs: the cached blocks
    follow_up = prompts[5] + list(answers["5"][1]) + pattern[:7]
    before = engine.stats()
    _run(engine, [(follow_up, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))])
    after = engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 32
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    assert after.spec_num_accepted_tokens - before.spec_num_accepted_tokens > 0.95 * drafted > 0
    engine.close()


def _spec_counts(engine: LLMEngine) -> tuple:
    stats = engine.stats()
    return (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
            stats.spec_accepted_per_position)  # fmt: skip


def test_pipelined_speculation_drafts_as_the_synchronous_engine(models) -> None:
    """The target as its own draft keeps every draft, so the optimistic schedule is never wrong
    and every step speculates as the synchronous engine's does: the same drafts, all kept, at the
    same positions, which needs the drafter's context (one lagging token after each step) made
    again on the worker exactly; and no step drains or waits once the first is launched."""
    target = models["target"]
    spec = json.dumps({"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
                       "disable_by_batch_size": 64})  # fmt: skip
    requests = _requests(1000)
    sync = _engine(target, spec)
    expected = _run(sync, requests)
    engine = _engine(target, spec, async_scheduling=True)
    assert _run(engine, requests) == expected == _baseline(target, "mixed", requests)
    counts = _spec_counts(engine)
    assert counts == _spec_counts(sync) and counts[1] == counts[2] > 0  # every draft kept
    pipeline = engine.pipeline
    assert pipeline.num_drains == 0 and pipeline.num_spec_waits <= 1 and pipeline.num_spec_pipelined > 3
    sync.close()
    engine.close()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("case", ["mixed", "preemption", "chunked"])
def test_rejected_drafts_move_the_next_step_back(models, case: str, method: str) -> None:
    """A perturbed draft has about half its drafts rejected: each pipelined step after one starts
    where the rejections put it (on the worker, and on the host once the step is read), so the
    tokens equal the synchronous engine's without speculation, under preemption and chunked
    prompts; each request drafts as it does in the synchronous speculating engine (its drafts
    capped by ``max_tokens`` from its real count, trimmed on the worker), so the speculation
    counters are that engine's (but under preemption, whose victims and their recomputed steps
    follow the schedule's timing); and nothing is left in the pool. N-gram drafts of a request
    whose step in flight is not read yet are proposed on the worker from its history."""
    target, spec = _spec(models, method, disable=64)
    knobs = CASE_KNOBS.get(case, {})
    requests = _requests(1000)
    sync = _engine(target, spec, **knobs)
    expected = _run(sync, requests)
    engine = _engine(target, spec, async_scheduling=True, **knobs)
    assert _run(engine, requests) == expected == _baseline(target, case, requests)  # no leaked blocks (checked)
    drafts, draft_tokens, accepted, _ = _spec_counts(engine)
    assert 0.1 * draft_tokens < accepted < draft_tokens
    assert engine.pipeline.num_spec_pipelined > 5 and engine.pipeline.num_drains == 0
    if case == "preemption":
        assert engine.stats().num_preemptions > 0
    else:
        assert _spec_counts(engine) == _spec_counts(sync)
    sync.close()
    engine.close()


@pytest.mark.parametrize("method", METHODS)
def test_seeded_requests_speculate_in_pipelined_steps(models, method: str) -> None:
    """Sampled requests (temperature, top-k, top-p) draw from their generators only on the worker,
    in the synchronous engine's order (the drafter's draws, then the verification's), and each
    step's drafts are capped from the real count: the same tokens and counters as the synchronous
    speculating engine, with every speculating step pipelined."""
    target, spec = _spec(models, method, disable=64)
    requests = [(prompt, SamplingParams(max_tokens=18 + 3 * s, temperature=0.9, top_p=0.95, top_k=50, seed=s,
                                        ignore_eos=True)) for s, (prompt, _) in enumerate(_requests(1000)[:5])]  # fmt: skip
    sync = _engine(target, spec)
    expected = _run(sync, requests)
    engine = _engine(target, spec, async_scheduling=True)
    assert _run(engine, requests) == expected
    assert _spec_counts(engine) == _spec_counts(sync) and _spec_counts(sync)[0] > 0
    assert engine.pipeline.num_spec_pipelined > 5 and engine.pipeline.num_drains == 0
    sync.close()
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("method", METHODS)
def test_on_cuda_pipelined_speculation_gives_the_synchronous_engines_tokens(models, method: str) -> None:
    """On a GPU (make gpu-check): greedy and seeded requests speculating in pipelined steps give the
    synchronous speculating engine's tokens and counters (the worker's host reads, the device's
    draws and the rebound chunks as on the CPU), with no step drained."""
    target, spec = _spec(models, method, disable=64)
    greedy = _requests(1000)[:4]
    seeded = [(prompt, SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True))
              for s, (prompt, _) in enumerate(_requests(1000)[4:])]  # fmt: skip
    requests = greedy + seeded
    sync = _engine(target, spec, device="cuda")
    expected = _run(sync, requests)
    engine = _engine(target, spec, device="cuda", async_scheduling=True)
    assert _run(engine, requests) == expected
    assert _spec_counts(engine) == _spec_counts(sync) and _spec_counts(sync)[0] > 0
    assert engine.pipeline.num_spec_pipelined > 3 and engine.pipeline.num_drains == 0
    sync.close()
    engine.close()


def test_a_step_that_drains_runs_its_chunks_from_the_real_counts(models) -> None:
    """A prompt-logprobs request arriving while pipelined speculating steps run makes one step
    drain: its chunks, scheduled from the optimistic counts with placeholders, are made again from
    the requests as the step before left them (rejected drafts taken off) and run synchronously;
    tokens and prompt logprobs equal the synchronous engine's without speculation."""
    target, spec = _spec(models, "draft_model", disable=64)
    requests = _requests(1000)
    requests[5] = (requests[5][0], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, prompt_logprobs=2))

    def run(engine: LLMEngine) -> dict[str, list]:
        out: dict[str, list] = {}
        for step in range(500):
            if step == 3:  # the late ones board while the first ones speculate
                for i, (prompt, params) in enumerate(requests[4:], start=4):
                    engine.add_request(str(i), prompt, params)
            elif step > 3 and not engine.has_unfinished_requests():
                break
            for o in engine.step():
                out.setdefault(o.req_id, []).extend(o.new_token_ids)
                if o.prompt_logprobs:
                    out.setdefault(f"{o.req_id}-prompt", []).extend((e.token_id, round(e.logprob, 4))
                                                                    for e in o.prompt_logprobs)  # fmt: skip
        assert engine.stats().num_used_kv_blocks == 0
        return out

    off = _engine(target, None)
    for i, (prompt, params) in enumerate(requests[:4]):
        off.add_request(str(i), prompt, params)
    engine = _engine(target, spec, async_scheduling=True, max_num_tokens=64)
    for i, (prompt, params) in enumerate(requests[:4]):
        engine.add_request(str(i), prompt, params)
    got = run(engine)
    assert got == run(off) and got["5-prompt"]
    pipeline = engine.pipeline
    assert pipeline.num_drains >= 1 and pipeline.num_spec_pipelined > 5 and engine.stats().spec_num_drafts > 0
    engine.close()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_failing_pipelined_step_fails_only_its_request(models, method: str, monkeypatch) -> None:
    """A forward pass that raises on the worker in a pipelined speculating step: the step after it
    is undone, the failed one's placeholders (one per position of a speculating row) are taken back
    and it runs again synchronously from the real counts, where only the request that causes it
    fails; the others keep the tokens of the engine without speculation, and no block leaks."""
    target, spec = _spec(models, method, disable=64)
    requests = _requests(1000)[:4]
    engine = _engine(target, spec, async_scheduling=True)
    fail_forward_of(monkeypatch, engine.runner, "poison")
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    got: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for step in range(500):
        if step == 4:  # the others speculate in pipelined steps by now
            engine.add_request("poison", requests[0][0], SamplingParams(max_tokens=6, temperature=0.0))
        elif step > 4 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                finish[out.req_id] = out.finish_reason
    assert finish["poison"] == "error" and engine.stats().num_used_kv_blocks == 0
    expected = _baseline(target, "mixed", _requests(1000))
    assert all(tuple(got[str(i)]) == expected[str(i)][1] for i in range(len(requests)))
    assert engine.pipeline.num_spec_pipelined > 3 and engine.pipeline.num_drains >= 1
    engine.close()


def _logprobs_run(engine: LLMEngine, requests) -> dict[str, list]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    entries: dict[str, list] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.new_logprobs is not None and len(out.new_logprobs) == len(out.new_token_ids)
            entries.setdefault(out.req_id, []).extend(
                (e.token_id, round(e.logprob, 4), tuple((t, round(v, 4)) for t, v in e.top)) for e in out.new_logprobs
            )
    return entries


@pytest.mark.parametrize("method", METHODS)
def test_pipelined_speculation_keeps_logprobs(models, method: str) -> None:
    """Greedy requests asking for logprobs speculate in pipelined steps too: each emitted token,
    drafts kept included, gets the entry the synchronous speculating engine gives it."""
    target, spec = _spec(models, method, disable=64)
    requests = [(p, SamplingParams(max_tokens=p_.max_tokens, temperature=0.0, ignore_eos=True, logprobs=2))
                for p, p_ in _requests(1000)[:4]]  # fmt: skip
    expected = _logprobs_run(_engine(target, spec), requests)
    engine = _engine(target, spec, async_scheduling=True)
    assert _logprobs_run(engine, requests) == expected
    assert engine.pipeline.num_spec_pipelined > 3 and engine.stats().spec_num_drafts > 0
    engine.close()


def test_a_sliding_window_model_drains_its_speculating_steps(tmp_path) -> None:
    """The scheduler releases a windowed request's blocks by its computed count, which runs ahead
    of the real one in a pipelined speculating step: such a model's speculating steps drain the
    pipeline instead, with the tokens of the synchronous engine without speculation."""
    target = make_demo_model(tmp_path / "mistral", "mistral", seed=5, config_overrides={"sliding_window": 8})
    spec = json.dumps({"method": "draft_model", "model": str(target), "num_speculative_tokens": 3,
                       "disable_by_batch_size": 64})  # fmt: skip
    requests = _requests(1000)
    engine = _engine(target, spec, async_scheduling=True)
    assert _run(engine, requests) == _run(_engine(target, None), requests)
    pipeline = engine.pipeline
    assert not pipeline.pipelines_speculation and pipeline.num_spec_pipelined == 0 and pipeline.num_drains > 0
    assert engine.stats().spec_num_drafts > 0
    engine.close()


def test_config_accepts_speculation() -> None:
    for method in ('"ngram"', '"draft_model", "model": "/models/d"', '"eagle3", "model": "/models/h"', '"mtp"'):
        spec = '{"method": ' + method + ', "num_speculative_tokens": 2}'
        assert EngineConfig(async_scheduling=True, speculative_config=spec).async_scheduling_on
