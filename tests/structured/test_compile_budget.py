"""Each client's allowance of grammar compile work: a cache hit is free, a client may have only
so many compiles under way, and one that has used its compile seconds is refused (429 with
``Retry-After``) until its bucket refills, while other clients compile as usual. Time is a fake
clock the test moves; slowness is an injected stall the test releases."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading

import pytest

from inflight.runtime.server.compile_budget import CompileBudget
from inflight.runtime.server.errors import APIError
from inflight.runtime.server.state import STATE
from inflight.runtime.structured.faults import GrammarFault

SLOW = "budget-marker"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _done(value: object = "compiled") -> concurrent.futures.Future[object]:
    future: concurrent.futures.Future[object] = concurrent.futures.Future()
    future.set_result(value)
    return future


def _unknown() -> bool:
    return False


def _known() -> bool:
    return True


async def _refused(budget: CompileBudget, client: str) -> APIError:
    submitted: list[object] = []

    def submit() -> concurrent.futures.Future[object]:
        submitted.append(1)
        return concurrent.futures.Future()

    with pytest.raises(APIError) as info:
        await asyncio.wait_for(budget.compile(client, submit, _unknown), 10)
    assert not submitted  # refused before anything is queued
    return info.value


def test_in_flight_limit_and_seconds_bucket_per_client() -> None:
    async def scenario() -> None:
        clock = _Clock()
        budget = CompileBudget(burst_s=2.0, refill_per_s=0.5, max_in_flight=1, clock=clock)
        assert await budget.compile("a", _done, _known) == "compiled"  # a cache hit: free, no slot taken
        first: concurrent.futures.Future[object] = concurrent.futures.Future()
        task = asyncio.ensure_future(budget.compile("a", lambda: first, _unknown))
        await asyncio.sleep(0)
        busy = await _refused(budget, "a")
        assert busy.status == 429 and busy.code == "compile_budget" and "compiling" in busy.message
        other: concurrent.futures.Future[object] = concurrent.futures.Future()
        other_task = asyncio.ensure_future(budget.compile("b", lambda: other, _unknown))  # another client is not held up
        clock.now += 5.0  # the first compile takes 5 s: a's 2 s bucket, plus 2.5 s refilled meanwhile, minus 5
        first.set_result("slow")
        other.set_result("quick")
        assert await task == "slow" and await other_task == "quick"
        empty = await _refused(budget, "a")
        assert empty.status == 429 and "allowance" in empty.message
        assert empty.headers is not None and int(empty.headers["Retry-After"]) >= 2  # 0.5 s deficit at 0.5 s/s
        assert await budget.compile("a", _done, _known) == "compiled"  # cache hits still answer
        clock.now += 4.0  # refilled past zero
        later: concurrent.futures.Future[object] = concurrent.futures.Future()
        later.set_result("again")
        assert await budget.compile("a", lambda: later, _unknown) == "again"
        assert budget.num_refused == 2

    asyncio.run(scenario())


def test_a_pending_compile_over_the_limit_is_refused_through_the_server(llama_server) -> None:  # noqa: ANN001
    """With one compile per client, a second distinct schema from the same key is a 429 while
    the first is stalled; a different key compiles and generates meanwhile. (A client is the
    key it authenticated with: for the test the server takes "hog" and "someone-else" as its
    two inference keys; without keys every local client would be one peer address.)"""
    openai = pytest.importorskip("openai")
    state = llama_server.app[STATE]
    engine = llama_server.engine
    budget, state.compile_budget = state.compile_budget, CompileBudget(max_in_flight=1)
    settings = state.settings
    state.settings = dataclasses.replace(settings, api_key="hog", priority_api_key="someone-else")
    deadline, engine.structured.compile_deadline_s = engine.structured.compile_deadline_s, 60.0
    engine.structured._fault = GrammarFault("slow-compile", SLOW)  # noqa: SLF001 - the injected fault

    def client(key: str):  # noqa: ANN202
        return openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key=key, max_retries=0, timeout=60)

    stalled: dict[str, object] = {}

    def first() -> None:
        try:
            stalled["reply"] = client("hog").completions.create(
                model="demo", prompt="x", max_tokens=2, extra_body={"guided_regex": f"{SLOW}a"})
        except Exception as exc:  # noqa: BLE001 - reported below
            stalled["reply"] = exc

    thread = threading.Thread(target=first)
    thread.start()
    try:
        for _ in range(500):  # until the hog's compile is under way
            if state.compile_budget._clients and next(iter(state.compile_budget._clients.values())).in_flight:  # noqa: SLF001
                break
            threading.Event().wait(0.01)
        with pytest.raises(openai.RateLimitError) as info:
            client("hog").completions.create(model="demo", prompt="x", max_tokens=2,
                                             extra_body={"guided_regex": f"{SLOW}b"})
        assert info.value.body["code"] == "compile_budget" and info.value.response.headers["Retry-After"]
        ok = client("someone-else").completions.create(model="demo", prompt="x", max_tokens=4,
                                                       extra_body={"guided_choice": ["yes", "no"]})
        assert ok.choices[0].text in ("yes", "no")
    finally:
        engine.structured._fault = None  # noqa: SLF001
        engine.structured.release_stalls()
        thread.join(60)
        state.compile_budget, engine.structured.compile_deadline_s = budget, deadline
        state.settings = settings
    assert not isinstance(stalled["reply"], Exception), stalled["reply"]
