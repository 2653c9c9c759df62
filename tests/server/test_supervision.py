"""Engine supervision: the engine thread's death (any BaseException), an EngineFatalError or a
stalled step turns /health and /ready to 503, answers every waiting client (503, or an error
event in a stream) and, in a real process, exits non-zero. A second SIGTERM
exits at once. Faults are injected with ``INFLIGHT_TEST_ENGINE_FAULT`` (tests only)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.engine_faults import FAULT_ENV
from inflight.runtime.outputs import EngineFatalError
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.engine_client import EngineDeadError
from inflight.runtime.server.engine_inproc import InprocEngine
from inflight.runtime.server.state import STATE
from tests.server.server_helpers import MODEL_NAME, LiveServer, ServeProcess, http, stream_error_code, wait_until

LONG = {"model": MODEL_NAME, "prompt": "# long\n", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
CONFIG = EngineConfig(max_num_sequences=2, num_kv_blocks=64, max_model_len=512)


async def _stream(url: str, started: asyncio.Event, body: dict | None = None) -> str:
    """How a stream ended: "completed", "error:<code>" or "silent-cut"."""
    code = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        try:
            async with session.post(f"{url}/v1/completions", json={**(body or LONG), "stream": True}) as resp:
                if resp.status != 200:  # refused at the door (e.g. the engine died before it was added)
                    return f"status:{resp.status}:{(await resp.json()).get('error', {}).get('code')}"
                async for raw in resp.content:
                    started.set()
                    code = stream_error_code(raw) or code
        except aiohttp.ClientError:
            return "silent-cut"
    return "completed" if code is None else f"error:{code}"


async def _plain(url: str) -> tuple[int, str | None]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.post(f"{url}/v1/completions", json=LONG) as resp:
            return resp.status, (await resp.json()).get("error", {}).get("code")


async def _clients(url: str, num_streams: int = 2, num_plain: int = 2) -> tuple[list[str], list[tuple[int, str | None]]]:
    started = asyncio.Event()
    streams = [asyncio.create_task(_stream(url, started)) for _ in range(num_streams)]
    plain = [asyncio.create_task(_plain(url)) for _ in range(num_plain)]
    return list(await asyncio.gather(*streams)), list(await asyncio.gather(*plain))


def _assert_dead(url: str, outcomes: tuple[list[str], list[tuple[int, str | None]]]) -> None:
    streams, plain = outcomes
    # A stream in flight gets an error event; one that arrives after the death a plain 503.
    assert streams and all(s in ("error:engine_dead", "status:503:engine_dead") for s in streams), streams
    assert plain and all(p == (503, "engine_dead") for p in plain), plain
    for probe in ("/health", "/ready"):
        reply = http("GET", url + probe)
        assert reply.status == 503 and reply.json()["status"] == "dead", reply.text
    reply = http("POST", url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert reply.status == 503 and reply.json()["error"]["code"] == "engine_dead"


@pytest.fixture
def faulty_server(demo_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    fault, settings = request.param
    live = LiveServer(demo_model_dir, CONFIG, ServerSettings(model_name=MODEL_NAME, **settings), fault=fault).start()
    yield live
    live.stop()


@pytest.mark.parametrize("faulty_server", [("die-after-steps:5", {})], indirect=True)
def test_engine_thread_death_answers_everyone(faulty_server: LiveServer) -> None:
    outcomes = asyncio.run(asyncio.wait_for(_clients(faulty_server.url), 60))
    _assert_dead(faulty_server.url, outcomes)
    state = faulty_server.app[STATE]
    assert state.dead.is_set() and "injected engine-thread death" in (state.engine.dead_reason or "")


@pytest.mark.parametrize("faulty_server", [("stall-after-steps:5", {"engine_stall_timeout_s": 1.0})], indirect=True)
def test_a_stalled_step_is_declared_dead(faulty_server: LiveServer) -> None:
    # The step never returns (injected): every client answered and the watchdog's reason show
    # that the 1 s stall timeout, not anything else, ended it.
    outcomes = asyncio.run(asyncio.wait_for(_clients(faulty_server.url), 60))
    _assert_dead(faulty_server.url, outcomes)
    assert "stall timeout" in (faulty_server.app[STATE].engine.dead_reason or "")


def test_engine_fatal_error_is_never_isolated(demo_model_dir: Path) -> None:
    live = LiveServer(demo_model_dir, CONFIG, ServerSettings(model_name=MODEL_NAME)).start()
    try:
        engine = live.app[STATE].engine.engine
        real_step = engine.step
        steps = iter(range(10**6))

        def step() -> list:
            if next(steps) == 4:
                raise EngineFatalError("a tensor-parallel worker died (injected)")
            return real_step()

        engine.step = step  # type: ignore[method-assign]
        outcomes = asyncio.run(asyncio.wait_for(_clients(live.url), 60))
        _assert_dead(live.url, outcomes)
        assert "tensor-parallel worker died" in (live.app[STATE].engine.dead_reason or "")
    finally:
        live.stop()


def _serve_args(demo_model_dir: Path, *extra: str) -> list[str]:
    return ["--model", str(demo_model_dir), "--served-model-name", MODEL_NAME, "--port", "0",
            "--max-num-sequences", "2", "--num-kv-blocks", "64", "--max-model-len", "512", *extra]


@pytest.mark.parametrize(("mode", "death"), [((), "the engine core died"),
                                            (("--single-process",), "the engine thread died")],
                         ids=["engine-core-process", "single-process"])  # fmt: skip
def test_injected_death_exits_the_process_non_zero(demo_model_dir: Path, mode: tuple[str, ...], death: str) -> None:
    server = ServeProcess(_serve_args(demo_model_dir, *mode), env={FAULT_ENV: "die-after-steps:20"})
    try:
        server.wait_ready()
        streams, plain = asyncio.run(asyncio.wait_for(_clients(server.url, 3, 3), 60))
        code = server.proc.wait(30)  # patience only: a process that stays up fails here
    finally:
        server.stop()
    assert all(s in ("error:engine_dead", "status:503:engine_dead") for s in streams), (streams, server.log())
    assert all(p == (503, "engine_dead") for p in plain), plain
    assert code == 1, server.log()
    log = server.log()
    assert death in log and "engine dead" in log


def test_a_second_sigterm_exits_at_once(demo_model_dir: Path) -> None:
    # Every step sleeps 100 ms (injected), so the stream's 480 steps outlast the 30 s we wait for
    # the exit: a process that waited for its drain instead of exiting fails, however fast the engine.
    server = ServeProcess(_serve_args(demo_model_dir, "--drain-timeout", "600"), env={FAULT_ENV: "slow-steps:100"})
    try:
        server.wait_ready()

        async def scenario() -> int:
            started = asyncio.Event()
            stream = asyncio.create_task(_stream(server.url, started, {**LONG, "max_tokens": 480, "n": 2}))
            await asyncio.wait_for(started.wait(), 30)
            server.terminate()
            while "draining" not in server.log():
                await asyncio.sleep(0.01)
            assert server.proc.poll() is None, server.log()  # draining: the stream is still running
            server.terminate()
            code = await asyncio.to_thread(server.proc.wait, 30)
            stream.cancel()
            return code

        code = asyncio.run(asyncio.wait_for(scenario(), 90))
    finally:
        server.stop()
    assert code == 128 + 15, server.log()
    assert "second SIGTERM" in server.log()


def test_a_request_the_engine_fails_on_fails_alone(demo_model_dir: Path) -> None:
    live = LiveServer(demo_model_dir, CONFIG, ServerSettings(model_name=MODEL_NAME)).start()
    try:
        engine = live.app[STATE].engine.engine
        real_sample = engine.sampler.sample

        def sample(logits, rows, *rest):  # a sampler bug that only one request's parameters trigger
            if any(r.params.seed == 13 for r in rows):
                raise RuntimeError("injected sampler failure")
            return real_sample(logits, rows, *rest)

        engine.sampler.sample = sample  # type: ignore[method-assign]
        healthy = {**LONG, "max_tokens": 40}
        reference = http("POST", f"{live.url}/v1/completions", healthy).json()["choices"][0]["text"]

        async def scenario() -> tuple[list[int], list[str], str]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                async def post(body: dict) -> tuple[int, dict]:
                    async with session.post(f"{live.url}/v1/completions", json=body) as resp:
                        return resp.status, await resp.json()

                poison = {**LONG, "seed": 13, "temperature": 0.8, "max_tokens": 40}
                results = await asyncio.gather(post(healthy), post(poison), post(healthy))
                streamed = await _stream_body(session, live.url, {**poison, "stream": True})
            statuses = [status for status, _ in results]
            texts = [body["choices"][0]["text"] for status, body in results if status == 200]
            return statuses, texts, streamed

        statuses, texts, streamed = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert statuses == [200, 500, 200]
        assert texts == [reference, reference]
        assert streamed == "error:internal_error"
        assert http("GET", f"{live.url}/health").status == 200
        assert wait_until(lambda: engine.stats().num_used_kv_blocks == 0, 10)
    finally:
        live.stop()


def test_a_step_that_raises_fails_its_requests_and_the_server_goes_on(demo_model_dir: Path) -> None:
    live = LiveServer(demo_model_dir, CONFIG, ServerSettings(model_name=MODEL_NAME)).start()
    try:
        engine = live.app[STATE].engine.engine
        real_step = engine.step
        calls = iter(range(10**6))

        def step() -> list:
            if next(calls) == 3:
                raise RuntimeError("injected scheduler bug")
            return real_step()

        engine.step = step  # type: ignore[method-assign]
        first = http("POST", f"{live.url}/v1/completions", LONG)
        assert first.status == 500 and first.json()["error"]["code"] == "internal_error"
        after = http("POST", f"{live.url}/v1/completions", {**LONG, "max_tokens": 8})
        assert after.status == 200 and http("GET", f"{live.url}/health").status == 200
    finally:
        live.stop()


async def _stream_body(session: aiohttp.ClientSession, url: str, body: dict) -> str:
    code = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        async for raw in resp.content:
            code = stream_error_code(raw) or code
    return "completed" if code is None else f"error:{code}"


def test_a_fatal_error_outside_the_step_also_kills_the_engine(demo_model_dir: Path) -> None:
    live = LiveServer(demo_model_dir, CONFIG, ServerSettings(model_name=MODEL_NAME)).start()
    try:
        engine = live.app[STATE].engine.engine

        def add_request(*args: object, **kwargs: object) -> None:
            raise EngineFatalError("a tensor-parallel worker died while adding (injected)")

        engine.add_request = add_request  # type: ignore[method-assign]
        reply = http("POST", f"{live.url}/v1/completions", LONG)
        assert reply.status == 503 and reply.json()["error"]["code"] == "engine_dead"
        assert wait_until(lambda: live.app[STATE].dead.is_set(), 10)
        assert http("GET", f"{live.url}/health").status == 503
    finally:
        live.stop()


class _Boom(BaseException):
    """Not an Exception: the engine thread dies of it."""


def test_a_command_sent_while_the_dead_thread_is_being_reported_is_answered() -> None:
    """The core's thread dies and its Dead message is on its way to the event loop; a command the
    loop was already about to send (after the thread stopped reading) still gets engine_dead,
    not silence. Deterministic: the loop is blocked until the thread is gone."""
    die = threading.Event()

    class DyingEngine:
        def warmup(self) -> None: ...

        def summary(self) -> object:
            return None

        def stats(self) -> object:
            return None

        def close(self) -> None: ...

        def has_unfinished_requests(self) -> bool:
            return die.is_set()

        def step(self) -> list:
            raise _Boom("injected")

    async def scenario() -> list[str]:
        deaths: list[str] = []
        engine = InprocEngine(DyingEngine, on_death=deaths.append)  # type: ignore[arg-type]
        engine.start()
        await engine.wait_ready()
        added = asyncio.create_task(engine.update_config({}))  # sends after the join below
        die.set()
        engine._core.thread.join(10)  # blocks the loop: Dead is handled after `added` has sent
        assert not engine._core.thread.is_alive()
        with pytest.raises(EngineDeadError, match="injected"):
            await asyncio.wait_for(added, 10)
        await engine.stop()
        return deaths

    deaths = asyncio.run(scenario())
    assert len(deaths) == 1 and "_Boom" in deaths[0]
