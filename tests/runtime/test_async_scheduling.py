"""Async scheduling (inflight.runtime.core.async_steps) on the CPU: the same tokens as the
synchronous engine, the one-step lag for stops, aborts and grammars, the overlap itself
(step N+1 is submitted while step N runs), and recovery when a step fails on the worker."""

from __future__ import annotations

import threading

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core import async_steps
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.structured.params import StructuredOutputsParams

Results = dict[str, tuple[list[int], str | None, list]]
CONFIG = dict(max_num_sequences=3, num_kv_blocks=64, max_model_len=128, max_num_tokens=64)


def _engine(model_dir, async_scheduling: bool, **overrides) -> LLMEngine:
    return LLMEngine.from_model_dir(model_dir, EngineConfig(**{**CONFIG, **overrides},
                                                            async_scheduling=async_scheduling))


def _drain(engine: LLMEngine, results: Results | None = None, max_steps: int = 400) -> Results:
    results = {} if results is None else results
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            ids, _, logprobs = results.setdefault(out.req_id, ([], None, []))
            ids.extend(out.new_token_ids)
            logprobs.extend(out.new_logprobs or ())
            if out.finished:
                results[out.req_id] = (ids, out.finish_reason, logprobs)
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_used_kv_blocks == 0
    return results


def _one_request(engine: LLMEngine) -> Results:
    """Run one greedy request of six tokens to its end, then close the engine."""
    engine.add_request("r", engine.encode_prompt("hello"), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    try:
        return _drain(engine)
    finally:
        engine.close()


def _workload(engine: LLMEngine, stop_id: int | None = None) -> None:
    enc = engine.encode_prompt
    engine.add_request("greedy", enc("def f(x):"), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
    engine.add_request("seeded", enc("hello world"), SamplingParams(max_tokens=11, temperature=0.9, seed=7,
                                                                     ignore_eos=True, logprobs=2))
    engine.add_request("penalized", enc("x = 1 + 2"), SamplingParams(max_tokens=8, temperature=1.0, seed=3,
                                                                      frequency_penalty=0.7, presence_penalty=0.3))
    engine.add_request("long", enc("import os\n" * 12), SamplingParams(max_tokens=5, temperature=0.0))  # chunked
    engine.add_request("short", enc("a"), SamplingParams(max_tokens=1, temperature=0.0))
    if stop_id is not None:
        engine.add_request("stopper", enc("def f(x):"),
                           SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_id], ignore_eos=True))


@pytest.fixture(scope="module")
def sync_engine(llama_dir) -> LLMEngine:
    return _engine(llama_dir, False, max_num_tokens=16)


@pytest.fixture(scope="module")
def async_engine(llama_dir) -> LLMEngine:
    engine = _engine(llama_dir, True, max_num_tokens=16)
    yield engine
    engine.close()


def _third_greedy_token(engine: LLMEngine) -> int:
    engine.add_request("probe", engine.encode_prompt("def f(x):"),
                       SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    return _drain(engine)["probe"][0][2]


def _assert_same_results(got: Results, expected: Results) -> None:
    """Token ids, finish reasons and logprob token ids exactly; logprob values to float32 rounding.

    The overlap's one-step lag can change which chunks share a step (a waiting prompt boards a
    step later), so a decode row may run in a pure-decode step on one side and beside a prompt
    chunk on the other. The two paths' products may round differently (MKL's AVX2 kernels do
    here): the logits then agree to ~1e-6, never exactly by design."""
    assert got.keys() == expected.keys()
    for req_id, (ids, reason, logprobs) in expected.items():
        got_ids, got_reason, got_logprobs = got[req_id]
        assert (got_ids, got_reason) == (ids, reason), req_id
        assert [(lp.token_id, [t for t, _ in lp.top], lp.rank) for lp in got_logprobs] == [
            (lp.token_id, [t for t, _ in lp.top], lp.rank) for lp in logprobs], req_id
        values = [[lp.logprob, *(v for _, v in lp.top)] for lp in logprobs]
        assert [[lp.logprob, *(v for _, v in lp.top)] for lp in got_logprobs] == [
            pytest.approx(v, rel=1e-5, abs=1e-5) for v in values], req_id


def test_tokens_equal_the_synchronous_engine(sync_engine: LLMEngine, async_engine: LLMEngine) -> None:
    stop_id = _third_greedy_token(sync_engine)
    _workload(sync_engine, stop_id)
    _workload(async_engine, stop_id)
    expected, got = _drain(sync_engine), _drain(async_engine)
    _assert_same_results(got, expected)
    assert got["stopper"][1] == "stop" and len(got["stopper"][0]) == 3
    assert async_engine.pipeline is not None and async_engine.pipeline.num_drains == 0


def _chunks_per_request(engine: LLMEngine, monkeypatch) -> dict[str, int]:
    counts: dict[str, int] = {}
    prepare = engine.runner.prepare

    def spy(chunks):
        for chunk in chunks:
            counts[chunk.req_id] = counts.get(chunk.req_id, 0) + 1
        return prepare(chunks)

    monkeypatch.setattr(engine.runner, "prepare", spy)
    return counts


def test_one_step_lag_a_stop_costs_one_thrown_away_row_and_length_costs_none(
    sync_engine: LLMEngine, async_engine: LLMEngine, monkeypatch
) -> None:
    stop_id = _third_greedy_token(sync_engine)
    runs = {}
    for name, engine in (("sync", sync_engine), ("async", async_engine)):
        counts = _chunks_per_request(engine, monkeypatch)
        enc = engine.encode_prompt
        engine.add_request("by-length", enc("def f(x):"), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        engine.add_request("by-stop", enc("def f(x):"), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                                      stop_token_ids=[stop_id]))
        runs[name] = (_drain(engine), dict(counts))
        monkeypatch.undo()
    (sync_out, sync_counts), (async_out, async_counts) = runs["sync"], runs["async"]
    assert async_out == sync_out
    assert async_counts["by-length"] == sync_counts["by-length"] == 4  # prompt + 3 decodes: nothing wasted
    assert async_counts["by-stop"] == sync_counts["by-stop"] + 1 == 4  # its next row ran, then was thrown away


def test_work_runs_on_the_worker_and_the_next_step_is_submitted_while_one_runs(llama_dir, monkeypatch) -> None:
    engine = _engine(llama_dir, True)
    pipeline = engine.pipeline
    assert pipeline is not None
    events: list[str] = []
    submitted_next = threading.Event()
    execute, sample = engine.runner.execute, engine.sampler.sample
    submit = pipeline.worker.submit
    forwards = 0

    def spy_submit(fn, *args):
        if fn == pipeline._forward_job:
            events.append("submit forward")
            if events.count("submit forward") == 3:
                submitted_next.set()
        return submit(fn, *args)

    def spy_execute(batch):
        nonlocal forwards
        assert pipeline.worker.on_worker, "forward passes run on the worker thread"
        forwards += 1
        events.append("forward start")
        if forwards == 2:  # a stalled step: the host must submit the third meanwhile
            assert submitted_next.wait(30), f"the host did not prepare step N+1 while step N ran: {events}"
        events.append("forward end")
        return execute(batch)

    def spy_sample(*args, **kwargs):
        assert pipeline.worker.on_worker, "sampling runs on the worker thread"
        return sample(*args, **kwargs)

    monkeypatch.setattr(pipeline.worker, "submit", spy_submit)
    monkeypatch.setattr(engine.runner, "execute", spy_execute)
    monkeypatch.setattr(engine.sampler, "sample", spy_sample)
    out = _one_request(engine)
    assert len(out["r"][0]) == 6
    third_submitted = [i for i, e in enumerate(events) if e == "submit forward"][2]
    second_ended = [i for i, e in enumerate(events) if e == "forward end"][1]
    assert third_submitted < second_ended, events


@pytest.mark.parametrize("issued_on_return", [False, True], ids=["in-place", "cuda-rule"])
def test_the_next_step_is_issued_before_the_host_turns_tokens_into_outputs(llama_dir, monkeypatch,
                                                                            issued_on_return: bool) -> None:
    """Each torch call on the worker releases the GIL: an engine thread that ran its outputs then
    would hold the device's next step back. A stalled start of step 3 must hold the outputs of
    step 2 until step 3 is issued: as its forward is called (the CPU, the simulated device), or
    once it returns (CUDA's rule, where ``execute`` only queues kernels; forced here on the CPU).
    Without the wait they are processed during the stall."""
    monkeypatch.setattr(async_steps, "issued_on_return", lambda device: issued_on_return)
    engine = _engine(llama_dir, True)
    pipeline = engine.pipeline
    assert pipeline is not None
    submit, process, execute = pipeline.worker.submit, engine.output_processor.process, engine.runner.execute
    forwards, executes, third_issued, processed_before = 0, 0, threading.Event(), []

    def stall() -> None:
        threading.Event().wait(0.3)  # a slow start of step 3 (the GIL taken, a long launch)
        third_issued.set()

    def spy_submit(fn, *args):
        nonlocal forwards
        if fn != pipeline._forward_job:
            return submit(fn, *args)
        forwards += 1
        if forwards != 3 or issued_on_return:
            return submit(fn, *args)

        def stalled(*job_args):
            stall()
            return fn(*job_args)

        return submit(stalled, *args)

    def spy_execute(batch):
        nonlocal executes
        executes += 1
        logits = execute(batch)
        if executes == 3 and issued_on_return:
            stall()  # after the pass: it counts as issued only on return
        return logits

    def spy_process(*args, **kwargs):
        if forwards >= 3 and not third_issued.is_set():
            processed_before.append(forwards)
        return process(*args, **kwargs)

    monkeypatch.setattr(pipeline.worker, "submit", spy_submit)
    monkeypatch.setattr(engine.runner, "execute", spy_execute)
    monkeypatch.setattr(engine.output_processor, "process", spy_process)
    out = _one_request(engine)
    assert len(out["r"][0]) == 6 and forwards >= 4 and third_issued.is_set()
    assert processed_before == [], "outputs were processed while the step after them waited to be issued"


def test_an_abort_while_a_step_is_in_flight(sync_engine: LLMEngine, async_engine: LLMEngine) -> None:
    results = {}
    for name, engine in (("sync", sync_engine), ("async", async_engine)):
        enc = engine.encode_prompt
        engine.add_request("keep", enc("def f(x):"), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.add_request("drop", enc("hello"), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        seen: Results = {}
        for _ in range(3):
            for out in engine.step():
                seen.setdefault(out.req_id, ([], None, []))[0].extend(out.new_token_ids)
        engine.abort_request("drop")
        results[name] = _drain(engine, seen)
    assert results["async"]["keep"] == results["sync"]["keep"]
    assert results["async"]["drop"][1] is None or results["async"]["drop"][1] == "abort"
    assert len(results["async"]["drop"][0]) < 8


def test_a_grammar_request_gets_the_same_tokens(llama_dir) -> None:
    spec = StructuredOutputsParams.regex(r"(ab|cd){2,5}x")
    got = {}
    for flag in (False, True):
        engine = _engine(llama_dir, flag)
        engine.add_request("g", engine.encode_prompt("say"), SamplingParams(max_tokens=20, temperature=0.0,
                                                                            structured=spec))
        engine.add_request("free", engine.encode_prompt("hi"), SamplingParams(max_tokens=9, temperature=0.0,
                                                                              ignore_eos=True))
        got[flag] = _drain(engine)
        engine.close()
    assert got[True] == got[False]
    assert got[True]["g"][1] == "stop"


def fail_forward_of(monkeypatch: pytest.MonkeyPatch, runner, req_id: str) -> None:
    """Make ``runner``'s forward pass raise whenever request ``req_id`` samples in the batch."""
    execute = runner.execute

    def failing(batch):
        if any(c.req_id == req_id for c in batch.sampled_chunks):
            raise RuntimeError("injected kernel failure")
        return execute(batch)

    monkeypatch.setattr(runner, "execute", failing)


@pytest.mark.parametrize("stage", ["forward", "sampling decision"])
def test_a_failing_step_fails_only_its_request(llama_dir, monkeypatch, stage: str) -> None:
    """A forward pass that raises on the worker, or a sampling decision (grammar masks) that
    raises on the host after the forward pass was submitted: the step runs again synchronously
    and only the request that causes it fails."""
    engine = _engine(llama_dir, True)
    reference = _engine(llama_dir, False)
    if stage == "forward":
        fail_forward_of(monkeypatch, engine.runner, "poison")
    else:
        settle = engine.sampler.settle_masks

        def failing_settle(rows, masks, vocab_size):
            if any(r.params.max_tokens == 4 for r in rows):  # the poison request's rows
                raise RuntimeError("injected grammar failure")
            return settle(rows, masks, vocab_size)

        monkeypatch.setattr(engine.sampler, "settle_masks", failing_settle)
    for e in (engine, reference):
        e.add_request("ok", e.encode_prompt("def f(x):"), SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    first = engine.step() + engine.step()  # "ok" is in flight when the poison arrives
    engine.add_request("poison", engine.encode_prompt("hello"), SamplingParams(max_tokens=4, temperature=0.0))
    results: Results = {}
    for out in first:
        results.setdefault(out.req_id, ([], None, []))[0].extend(out.new_token_ids)
    results = _drain(engine, results)
    expected = _drain(reference)
    engine.close()
    assert results["poison"][1] == "error"
    assert results["ok"][:2] == expected["ok"][:2]
    assert engine.pipeline is not None and engine.pipeline.num_drains >= 1


def test_prompt_logprobs_drain_the_pipeline(llama_dir) -> None:
    got = {}
    for flag in (False, True):
        engine = _engine(llama_dir, flag)
        engine.add_request("a", engine.encode_prompt("def f(x):"), SamplingParams(max_tokens=6, temperature=0.0,
                                                                                  ignore_eos=True))
        first = engine.step()
        engine.add_request("p", engine.encode_prompt("hello world"), SamplingParams(max_tokens=3, temperature=0.0,
                                                                                    prompt_logprobs=1))
        got[flag] = _drain(engine, {o.req_id: (list(o.new_token_ids), None, []) for o in first})
        if flag:
            assert engine.pipeline is not None and engine.pipeline.num_drains >= 1
        engine.close()
    assert got[True] == got[False]


def test_combines_with_speculation_and_tensor_parallelism() -> None:  # test_async_speculative.py, ..._tensor_parallel.py
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert EngineConfig(async_scheduling=True, speculative_config=spec, tensor_parallel_size=2).async_scheduling_on

