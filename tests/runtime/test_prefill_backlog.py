"""The engine's TTFT-backlog figures (inflight.runtime.core.prefill_backlog) on the simulated
device with a zero step time: the backlog of waiting and half-computed prompts, the prefill
tokens computed, the rate's guard (0 until a prefill step ran). Counts, never speeds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core import prefill_backlog
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.request import Request
from inflight.runtime.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def zero_profile(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("sim") / "zero.json"
    path.write_text(json.dumps({"base_ms": 0, "decode_row_ms": 0, "prefill_token_ms": 0,
                                "attention_ms_per_1k_context": 0}))
    return str(path)


def _engine(model_dir: Path, profile: str, **extra: object) -> LLMEngine:
    values: dict[str, object] = {"num_kv_blocks": 64, "max_model_len": 256, "max_num_sequences": 4,
                                 "enable_prefix_caching": False, **extra}
    config = EngineConfig(device="sim", sim_profile=profile, **values)  # type: ignore[arg-type]
    return LLMEngine.from_model_dir(model_dir, config)


def _prompt(n: int, salt: int) -> list[int]:
    return [(salt * 31 + i) % 200 + 3 for i in range(n)]


def _drain(engine: LLMEngine) -> None:
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests in 500 steps")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_backlog_counts_waiting_and_half_computed_prompts(llama_dir: Path, zero_profile: str,
                                                          async_scheduling: bool) -> None:
    engine = _engine(llama_dir, zero_profile, max_num_tokens=32, enable_chunked_context=True,
                     async_scheduling=async_scheduling)
    try:
        assert engine.stats().prefill_tokens_per_second == 0.0  # no prefill yet: no rate, not infinity
        lengths = [70, 50, 40]
        for i, n in enumerate(lengths):
            engine.add_request(f"r{i}", _prompt(n, i), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        stats = engine.stats()
        assert stats.num_prefill_backlog_tokens == sum(lengths)
        assert stats.num_prefill_computed_tokens == 0
        engine.step()  # one chunk of 32 tokens of the first prompt
        stats = engine.stats()
        assert 0 < stats.num_prefill_computed_tokens <= 32
        assert stats.num_prefill_backlog_tokens + stats.num_prefill_computed_tokens == sum(lengths)
        assert stats.prefill_tokens_per_second > 0.0
        _drain(engine)
        stats = engine.stats()
        assert stats.num_prefill_backlog_tokens == 0
        assert stats.num_prefill_computed_tokens == sum(lengths)
    finally:
        engine.close()


def test_abort_and_one_token_requests_leave_the_backlog(llama_dir: Path, zero_profile: str) -> None:
    engine = _engine(llama_dir, zero_profile, max_num_sequences=1, async_scheduling=False)
    try:
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.add_request("a", _prompt(60, 1), one)
        engine.add_request("b", _prompt(30, 2), one)
        engine.abort_request("b")  # waiting: its prompt leaves the backlog unprefilled
        assert engine.stats().num_prefill_backlog_tokens == 60
        engine.step()  # "a" is prefilled and finishes in the same step (max_tokens=1)
        stats = engine.stats()
        assert (stats.num_prefill_backlog_tokens, stats.num_prefill_computed_tokens) == (0, 60)
        assert stats.prefill_tokens_per_second > 0.0  # the step that finished it still measured the rate
        assert not engine.has_unfinished_requests()
    finally:
        engine.close()


def test_preempted_requests_return_to_the_backlog(llama_dir: Path, zero_profile: str) -> None:
    # 6 blocks of 16 slots for 3 requests that each grow to 2-3 blocks: someone is preempted.
    engine = _engine(llama_dir, zero_profile, num_kv_blocks=6, max_num_sequences=3, async_scheduling=False)
    try:
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        for i in range(3):
            engine.add_request(f"p{i}", _prompt(24, i), params)
        _drain(engine)
        stats = engine.stats()
        assert stats.num_preemptions > 0
        assert stats.num_prefill_backlog_tokens == 0
        assert stats.num_prefill_computed_tokens > 3 * 24  # the recomputes were prefill work too
    finally:
        engine.close()


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_counts_backlogged_time_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain rate with a fake clock: tokens over the wall time while a backlog existed,
    from the arrival that started it; the idle gap after it is not counted."""
    clock = _Clock()
    monkeypatch.setattr(prefill_backlog.time, "monotonic", clock)
    meter = prefill_backlog.PrefillBacklog()
    req = Request("a", _prompt(300, 0), SamplingParams(max_tokens=1))
    meter.added(req)
    assert (meter.num_backlog_tokens, meter.tokens_per_second) == (300, 0.0)
    meter.admitted(req)
    for _ in range(3):  # 100 tokens a step, a step a second
        req.num_computed_tokens += 100
        clock.now += 1.0
        meter.stepped(clock.now)
    assert meter.num_backlog_tokens == 0 and meter.num_computed_tokens == 300
    assert meter.tokens_per_second == pytest.approx(100.0)
    clock.now += 1000.0  # idle: no backlog, no time counted
    late = Request("b", _prompt(200, 1), SamplingParams(max_tokens=1))
    meter.added(late)
    meter.admitted(late)
    clock.now += 1.0
    meter.stepped(clock.now)  # a stalled step: the backlog did not move
    late.num_computed_tokens += 200
    clock.now += 1.0
    meter.stepped(clock.now)
    assert meter.tokens_per_second == pytest.approx(100.0, rel=0.2)  # 500 tokens over ~5 s, decayed
    assert meter.num_backlog_tokens == 0
