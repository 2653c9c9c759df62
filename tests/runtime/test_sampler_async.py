"""Sampling split at the device boundary (worker/sampler.py ``start_sample``): async scheduling's
worker queues a step's sampling and starts the tokens' copy to the host without reading any
value, so it launches step N+1 before anything waits for N; the engine thread waits for the
copy when it needs the tokens. On the CPU the "device" is the CPU: the test is that no host
read of a tensor happens on the worker's side of the split (the guard the CUDA-graph capture
uses), and that the tokens are the synchronous engine's."""

from __future__ import annotations

import pytest
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.async_steps import StepPipeline
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.structured.params import StructuredOutputsParams
from inflight.runtime.worker.graph_backend import HostSyncError, no_host_sync
from inflight.runtime.worker.sampler import Sampler, SamplingRow, SettledMasks


def _rows(n: int) -> list[SamplingRow]:
    kinds = [SamplingParams(temperature=0.8, top_p=0.9, logprobs=2, seed=1),
             SamplingParams(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.2),
             SamplingParams(temperature=0.7, top_k=4, min_tokens=3, stop_token_ids=(2,))]  # fmt: skip
    return [SamplingRow(kinds[i % 3], [1, 2, 3], [4, 4, 5], torch.Generator().manual_seed(i), (0,)) for i in range(n)]


def test_start_sample_reads_nothing_back_and_result_equals_sample():
    logits = torch.randn(9, 32, generator=torch.Generator().manual_seed(0))
    with no_host_sync():
        pending = Sampler(torch.device("cpu")).start_sample(logits.clone(), _rows(9))
    got = pending.result()
    want = Sampler(torch.device("cpu")).sample(logits.clone(), _rows(9))
    assert got.token_ids == want.token_ids == pending.token_ids.tolist()
    assert [lp and (lp.token_id, lp.top) for lp in got.logprobs] == [lp and (lp.token_id, lp.top)
                                                                    for lp in want.logprobs]  # fmt: skip


def test_deferred_rows_are_minus_one_on_the_device_and_in_the_output():
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    settled = SettledMasks((), None, frozenset({1, 3}))
    with no_host_sync():
        pending = Sampler(torch.device("cpu")).start_sample(logits, _rows(5), settled)
    out = pending.result()
    assert out.deferred == frozenset({1, 3})
    assert out.token_ids[1] == out.token_ids[3] == -1 and min(out.token_ids[i] for i in (0, 2, 4)) >= 0
    assert pending.token_ids.tolist() == out.token_ids


def _engine(model_dir, async_scheduling: bool) -> LLMEngine:
    config = EngineConfig(max_num_sequences=3, num_kv_blocks=64, max_model_len=128, max_num_tokens=64,
                          async_scheduling=async_scheduling)  # fmt: skip
    return LLMEngine.from_model_dir(model_dir, config)


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    enc = engine.encode_prompt
    for i, (prompt, params) in enumerate([
        ("def f(x):", SamplingParams(max_tokens=9, temperature=0.9, seed=7, ignore_eos=True, logprobs=2)),
        ("hello world", SamplingParams(max_tokens=7, temperature=1.0, seed=3, frequency_penalty=0.7,
                                       ignore_eos=True)),
        ("x = 1 + 2", SamplingParams(max_tokens=8, temperature=0.6, top_k=5, seed=11, ignore_eos=True)),
        ("pick:", SamplingParams(max_tokens=6, temperature=0.8, seed=5,
                                 structured=StructuredOutputsParams.regex("(ab|cd)+"))),  # a grammar mask
    ]):  # fmt: skip
        engine.add_request(str(i), enc(prompt), params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    return tokens


def test_the_worker_never_waits_on_a_step_it_sampled(llama_dir, monkeypatch):
    """Every sampling job on the worker runs under the host-sync guard: a ``.tolist()`` (or any
    read) there would be the worker waiting for step N before it can launch N+1."""
    original = StepPipeline._sample_job
    caught: list[HostSyncError] = []

    def guarded(self, *args):  # type: ignore[no-untyped-def]
        try:
            with no_host_sync():
                return original(self, *args)
        except HostSyncError as exc:
            caught.append(exc)
            raise

    monkeypatch.setattr(StepPipeline, "_sample_job", guarded)
    engine = _engine(llama_dir, True)
    got = _run(engine)
    assert caught == []
    assert engine.pipeline is not None and engine.pipeline.num_drains == 0
    assert got == _run(_engine(llama_dir, False))  # and the tokens are the synchronous engine's


def test_the_guard_would_catch_a_blocking_sample_job(llama_dir, monkeypatch):
    """The test above can fail: a sampling job that reads its tokens back trips the guard."""
    original = StepPipeline._sample_job
    caught: list[HostSyncError] = []

    def blocking(self, *args):  # type: ignore[no-untyped-def]
        try:
            with no_host_sync():
                sampled = original(self, *args)
                sampled.token_ids.tolist()  # what the worker did before: wait for the tokens
                return sampled
        except HostSyncError as exc:
            caught.append(exc)
            raise

    monkeypatch.setattr(StepPipeline, "_sample_job", blocking)
    _run(_engine(llama_dir, True))
    assert caught


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_start_sample_does_not_sync():
    dev = torch.device("cuda")
    rows = _rows(16)
    for r in rows:
        r.generator = torch.Generator(dev).manual_seed(r.generator.initial_seed())
    logits = torch.randn(16, 32).to(dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = Sampler(dev).start_sample(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = pending.result()
    assert out.token_ids == pending.token_ids.tolist()
