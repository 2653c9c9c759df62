"""A slow grammar delays only its own request: a row whose token mask is not ready when its
step samples is deferred and its request parked, so the other requests of the batch take
exactly the steps they take alone, and the parked request's output, once its mask is ready,
is token for token what it is without the delay (a quick grammar's row may also be
deferred now and then, when its mask misses the grace; its tokens do not change either). The late fill's thread drops to the lowest
CPU priority. Slowness is an injected stall the test releases, never a raced clock."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.request import Request
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.structured import StructuredOutputsParams, mask_fills
from inflight.runtime.structured.faults import GrammarFault
from inflight.runtime.structured.manager import RequestMatcher
from inflight.runtime.structured.mask_fills import LOWEST_PRIORITY, QUICK_AGAIN_S, MaskFill, MaskFiller

SLOW = "parked-marker"
CONFIG = EngineConfig(max_num_sequences=4, num_kv_blocks=128, max_model_len=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("mask-parking") / "llama", arch="llama", size="tiny")


def _requests(slow_regex: str = "(xy|z)+") -> dict[str, SamplingParams]:
    return {
        "free": SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        "seeded": SamplingParams(max_tokens=10, temperature=0.8, seed=7, ignore_eos=True),
        "constrained": SamplingParams(max_tokens=10, temperature=0.0, structured=StructuredOutputsParams.regex("(ab|cd)+")),
        "slow": SamplingParams(max_tokens=8, temperature=0.7, seed=3,
                               structured=StructuredOutputsParams.regex(f"({SLOW})?{slow_regex}")),
    }


class _Run:
    """Drive an engine step by step, recording each request's tokens and finishing step."""

    def __init__(self, engine: LLMEngine, requests: dict[str, SamplingParams]) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {r: [] for r in requests}
        self.finished_at: dict[str, int] = {}
        self.reasons: dict[str, str | None] = {}
        self.steps = 0
        for req_id, params in requests.items():
            engine.add_request(req_id, engine.encode_prompt(f"prompt for {req_id}"), params)

    def until(self, done: object, max_steps: int = 400) -> None:
        for _ in range(max_steps):
            if done():  # type: ignore[operator]
                return
            self.steps += 1
            for out in self.engine.step():
                self.tokens[out.req_id].extend(out.new_token_ids)
                if out.finished:
                    self.finished_at[out.req_id] = self.steps
                    self.reasons[out.req_id] = out.finish_reason
        raise AssertionError(f"not done after {max_steps} steps: {self.finished_at}")


def _record_parks(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the requests ``engine`` parks, in order, one entry per park."""
    parks: list[str] = []
    park = engine.parked.park

    def recording_park(req: Request, matcher: RequestMatcher) -> None:
        parks.append(req.req_id)
        park(req, matcher)

    monkeypatch.setattr(engine.parked, "park", recording_park)
    return parks


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("slow_regex", ["(xy|z)+", "(ab|cd){3}"], ids=["open-ended", "completes"])
def test_a_stalled_mask_parks_only_its_request_and_its_output_is_unchanged(
    model_dir: Path, slow_regex: str, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the stall the grammar stays slow (no fill is cheap enough to make it quick again
    here), so each later token advances it off the step, with its request parked (and
    ``(ab|cd){3}`` completes there): the output must still be the reference's."""
    monkeypatch.setattr(mask_fills, "QUICK_AGAIN_S", 0.0)
    config = CONFIG.replace(async_scheduling=async_scheduling)  # async: the one-step lag changes nothing here
    reference = _Run(LLMEngine.from_model_dir(model_dir, config), _requests(slow_regex))
    reference.until(lambda: not reference.engine.has_unfinished_requests())

    engine = LLMEngine.from_model_dir(model_dir, config)
    engine.structured._fault = GrammarFault("slow-mask", SLOW)  # noqa: SLF001 - the injected fault
    engine.parked.deadline_s = 60.0
    parks = _record_parks(engine, monkeypatch)
    run = _Run(engine, _requests(slow_regex))
    others, free = ("free", "seeded", "constrained"), ("free", "seeded")
    try:
        run.until(lambda: all(r in run.finished_at for r in others))
        # The free requests took exactly the steps they take beside a quick grammar (the quick
        # grammar's own steps depend on how fast its masks are), and all have the same tokens.
        assert {r: run.finished_at[r] for r in free} == {r: reference.finished_at[r] for r in free}
        assert {r: run.tokens[r] for r in others} == {r: reference.tokens[r] for r in others}
        assert "slow" not in run.finished_at and run.tokens["slow"] == []
        # The stall parked the slow request once, and it is the one still parked. (The quick
        # grammar's row may have been deferred too, when a busy machine made its mask miss the
        # grace: that is timing, so the test does not count it.)
        assert parks.count("slow") == 1 and set(parks) <= {"slow", "constrained"}
        assert len(engine.parked) == 1 and engine.parked.is_parked("slow")
        assert engine.stats().num_running == 1  # parked, not preempted: it keeps its blocks
    finally:
        engine.structured.release_stalls()
    run.until(lambda: not engine.has_unfinished_requests())
    assert run.tokens["slow"] == reference.tokens["slow"] and run.reasons["slow"] == reference.reasons["slow"]
    assert parks.count("slow") >= len(run.tokens["slow"])  # the stall, then after each unfinished token
    assert engine.parked.num_parked_total == len(parks)
    assert len(engine.parked) == 0 and engine.stats().num_used_kv_blocks == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_abort_while_parked_frees_everything(model_dir: Path, async_scheduling: bool) -> None:
    engine = LLMEngine.from_model_dir(model_dir, CONFIG.replace(async_scheduling=async_scheduling))
    engine.structured._fault = GrammarFault("slow-mask", SLOW)  # noqa: SLF001
    engine.parked.deadline_s = 60.0
    requests = {k: v for k, v in _requests().items() if k in ("free", "slow")}
    run = _Run(engine, requests)
    try:
        run.until(lambda: "free" in run.finished_at)
        assert len(engine.parked) == 1
        out = engine.abort_request("slow")
        assert out is not None and out.finish_reason == "abort"
        run.until(lambda: not engine.has_unfinished_requests())
        assert len(engine.parked) == 0 and engine.stats().num_used_kv_blocks == 0
    finally:
        engine.structured.release_stalls()


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_a_late_fill_drops_to_the_lowest_priority_and_its_grammar_is_then_slow(model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(model_dir, CONFIG)
    engine.structured._fault = GrammarFault("slow-mask", SLOW)  # noqa: SLF001
    filler = MaskFiller()
    matcher = engine.structured.new_matcher(StructuredOutputsParams.regex(f"({SLOW})?a+"))
    try:
        fill = filler.fill(matcher, engine.vocab_size)
        assert filler.fill(matcher, engine.vocab_size) is fill  # one fill per position
        _wait_running(fill)
        thread = fill._thread  # noqa: SLF001 - the worker the fill runs on
        assert thread is not None and os.getpriority(os.PRIO_PROCESS, thread.native_id) == 0
        filler.late(fill)
        assert matcher.slow and os.getpriority(os.PRIO_PROCESS, thread.native_id) == LOWEST_PRIORITY
        time.sleep(2 * QUICK_AGAIN_S)  # the stall (counted as cost) lasts at least this long
    finally:
        engine.structured.release_stalls()
    fill.future.result(timeout=30)
    assert fill.cost_s() > 0  # the injected stall counts as the fill's cost
    filler.consume(fill)
    assert matcher.fill is None and matcher.slow  # a costly fill keeps its grammar slow
    nxt = filler.fill(matcher, engine.vocab_size)  # now on a lowest-priority thread
    nxt.future.result(timeout=30)
    assert nxt._thread is not None and nxt._thread.lowered  # noqa: SLF001
    filler.close()


def _wait_running(fill: MaskFill) -> None:
    ready = threading.Event()
    for _ in range(1000):
        if fill._thread is not None:  # noqa: SLF001
            return
        ready.wait(0.01)
    raise AssertionError("the fill never started")
