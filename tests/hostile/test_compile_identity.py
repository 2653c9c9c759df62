"""Issue 46, finding 4: the compile allowance was keyed on the raw ``Authorization`` header (four
spellings of one key, four allowances) and compiles queued first come, first served (one
client's backlog put another's small schema behind all of it).

Now the allowance belongs to the authenticated principal, and compiles wait for one of a few
slots in turns taken round-robin between principals. Slowness is an injected stall the test
releases, or a fake compile future the test settles; nothing here knows how fast anything is."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.runtime.server.compile_budget import CompileBudget
from inflight.runtime.server.errors import APIError
from inflight.runtime.server.state import STATE
from inflight.runtime.structured.faults import GrammarFault
from tests.server.server_helpers import LiveServer, http

KEY = "shared-key-1"
SLOW = "identity-marker"
SPELLINGS = [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}", f"Bearer   {KEY}  "]


def _unknown() -> bool:
    return False


class _Pool:
    """A one-worker compile pool the test drives: ``submit`` queues, ``finish`` settles the oldest."""

    def __init__(self) -> None:
        self.queued: list[tuple[str, concurrent.futures.Future[str]]] = []
        self.started: list[str] = []

    def submit(self, name: str):  # noqa: ANN201 - a submit() for CompileBudget.compile
        def submit() -> concurrent.futures.Future[str]:
            future: concurrent.futures.Future[str] = concurrent.futures.Future()
            self.queued.append((name, future))
            self.started.append(name)
            return future
        return submit

    def finish(self) -> None:
        name, future = self.queued.pop(0)
        future.set_result(name)


async def _settle() -> None:
    for _ in range(10):  # let woken tasks run up to their next await
        await asyncio.sleep(0)


def test_a_second_principal_goes_ahead_of_the_first_ones_backlog() -> None:
    async def scenario() -> list[str]:
        pool = _Pool()
        budget = CompileBudget(max_in_flight=4, max_running=1)
        tasks = [asyncio.ensure_future(budget.compile("key:a", pool.submit(f"a{i}"), _unknown)) for i in range(4)]
        await _settle()
        tasks.append(asyncio.ensure_future(budget.compile("key:b", pool.submit("b0"), _unknown)))
        await _settle()
        assert pool.started == ["a0"] and budget.num_waiting == 4  # one slot: the rest wait for turns
        while pool.queued:
            pool.finish()
            await _settle()
        assert [await t for t in tasks] == ["a0", "a1", "a2", "a3", "b0"]
        assert budget.num_running == budget.num_waiting == 0
        return pool.started

    assert asyncio.run(scenario()) == ["a0", "b0", "a1", "a2", "a3"]  # b behind one of a's, not four


def test_a_waiting_compile_whose_client_left_gives_its_turn_away() -> None:
    async def scenario() -> None:
        pool = _Pool()
        budget = CompileBudget(max_in_flight=2, max_running=1)
        first = asyncio.ensure_future(budget.compile("key:a", pool.submit("a0"), _unknown))
        await _settle()
        gone = asyncio.ensure_future(budget.compile("key:a", pool.submit("a1"), _unknown))
        other = asyncio.ensure_future(budget.compile("key:b", pool.submit("b0"), _unknown))
        await _settle()
        gone.cancel()
        await _settle()
        pool.finish()
        await _settle()
        assert pool.started == ["a0", "b0"]
        pool.finish()
        assert await first == "a0" and await other == "b0" and gone.cancelled()
        assert budget.num_running == budget.num_waiting == 0
        # The slot is free again: the next compile starts at once.
        again = asyncio.ensure_future(budget.compile("key:a", pool.submit("a2"), _unknown))
        await _settle()
        pool.finish()
        assert await again == "a2"

    asyncio.run(scenario())


def test_too_many_waiting_compiles_are_refused_before_queueing() -> None:
    async def scenario() -> None:
        pool = _Pool()
        budget = CompileBudget(max_in_flight=1, max_running=1, max_waiting=1)
        running = asyncio.ensure_future(budget.compile("key:a", pool.submit("a0"), _unknown))
        waiting = asyncio.ensure_future(budget.compile("key:b", pool.submit("b0"), _unknown))
        await _settle()
        with pytest.raises(APIError) as info:
            await budget.compile("key:c", pool.submit("c0"), _unknown)
        assert info.value.status == 429 and info.value.code == "compile_budget"
        assert pool.started == ["a0"]
        pool.finish()
        await _settle()
        pool.finish()
        assert await running == "a0" and await waiting == "b0"

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server with one inference key and its engine in this process (the test reaches its
    grammar compiler to stall a compile)."""
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.demo.model import make_demo_model
    from inflight.runtime.server import ServerSettings

    model_dir: Path = make_demo_model(tmp_path_factory.mktemp("identity-model") / "demo", size="tiny")
    live = LiveServer(model_dir, EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=256),
                      ServerSettings(model_name="demo", api_key=KEY)).start()
    yield live
    live.stop()


def test_four_spellings_of_one_key_share_one_allowance(keyed: LiveServer) -> None:
    """With one compile per principal, a stalled compile under one spelling of the key makes a
    compile under each other spelling a 429: one key, one allowance."""
    state = keyed.app[STATE]
    structured = keyed.engine.structured
    budget, state.compile_budget = state.compile_budget, CompileBudget(max_in_flight=1)
    structured._fault = GrammarFault("slow-compile", SLOW)  # noqa: SLF001 - the injected fault
    stalled: dict[str, object] = {}

    def first() -> None:
        body = {"model": "demo", "prompt": "x", "max_tokens": 2, "guided_regex": f"{SLOW}a"}
        stalled["reply"] = http("POST", f"{keyed.url}/v1/completions", body, {"Authorization": SPELLINGS[0]}, 60)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        for _ in range(500):  # until the stalled compile holds the principal's one slot
            if state.compile_budget.num_running:
                break
            threading.Event().wait(0.01)
        assert [*state.compile_budget._clients] == ["key:" + _digest(KEY)]  # noqa: SLF001
        for i, spelling in enumerate(SPELLINGS[1:]):
            body = {"model": "demo", "prompt": "x", "max_tokens": 2, "guided_regex": f"b{i}[0-9]"}
            reply = http("POST", f"{keyed.url}/v1/completions", body, {"Authorization": spelling})
            assert reply.status == 429 and reply.json()["error"]["code"] == "compile_budget", (spelling, reply.text)
        assert state.compile_budget.num_refused == 3
    finally:
        structured._fault = None  # noqa: SLF001
        structured.release_stalls()
        thread.join(60)
        state.compile_budget = budget
    assert stalled["reply"].status == 200  # type: ignore[attr-defined]


def _digest(key: str) -> str:
    from inflight.runtime.server.principal import key_digest

    return key_digest(key)
