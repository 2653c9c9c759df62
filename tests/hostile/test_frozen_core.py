"""A frozen core must not look healthy (issue 46, finding 5).

An engine core SIGSTOPped while idle never starts a step, so the step clock alone never saw it:
``/health`` said 200 and requests hung until SIGCONT. The core now answers a heartbeat
(``Ping`` -> ``Pong``) between steps, and the watchdog declares an engine that answers none for
the stall timeout dead: every waiting client gets 503 ``engine_dead``, ``/health`` and
``/ready`` say 503, the core is killed and ``inflight serve`` exits 1, as on a crash. The
in-process engine runs the same loop on a thread, over an in-memory channel, and answers the same way.

The watchdog's verdict is tested tick by tick on a fake engine (no clock, no sleep); the
servers are real (an engine-core process stopped with SIGSTOP, an engine thread held between
steps), and every wait on them is patience only: a server that hangs fails by its bound, never
by how fast it answered. No test leaves a stopped process behind.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.engine_core import protocol as p
from inflight.runtime.engine_core.core import EngineCore
from inflight.runtime.engine_core.inproc import ThreadStepClock, duplex
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.state import STATE
from inflight.runtime.server.watchdog import StallWatch
from tests.server.server_helpers import MODEL_NAME, LiveServer, ServeProcess, http, stream_error_code

CONFIG = EngineConfig(max_num_sequences=2, num_kv_blocks=64, max_model_len=256)
STALL_S = 1.0
BODY = {"model": MODEL_NAME, "prompt": "# frozen\n", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
PATIENCE_S = 60  # a bound on a hang, never a measure of speed
DEAD = ("error:engine_dead", "status:503:engine_dead")


# ---- the verdict, tick by tick -----------------------------------------------------------


class FakeEngine:
    """What the watchdog reads; ``answering`` says whether the loop answers a ping at once."""

    def __init__(self) -> None:
        self.heartbeat = 0
        self.is_ready = True
        self.step_started_at: float | None = None
        self.answering = True
        self.pings = 0
        self.unanswered: int | None = None  # a ping sent while not answering

    def ping(self) -> None:
        if self.unanswered is not None:
            return  # as EngineClient.ping: one outstanding heartbeat at a time
        self.pings += 1
        if self.answering:
            self.heartbeat = self.pings
        else:
            self.unanswered = self.pings

    def deliver(self) -> None:
        """The late answer arrives (a loop that was only slow)."""
        if self.unanswered is not None:
            self.heartbeat, self.unanswered = self.unanswered, None


def _ticks_until_verdict(watch: StallWatch, engine: FakeEngine, max_ticks: int) -> tuple[int, str | None]:
    for tick in range(1, max_ticks + 1):
        reason = watch.tick(engine, now=float(tick))
        if reason is not None:
            return tick, reason
    return max_ticks, None


def test_an_idle_engine_that_stops_answering_is_dead_after_the_timeouts_ticks() -> None:
    watch, engine = StallWatch(10.0), FakeEngine()
    assert (watch.interval_s, watch.max_missed) == (1.0, 10)
    assert _ticks_until_verdict(watch, engine, 500) == (500, None)  # an idle, answering loop lives
    engine.answering = False  # SIGSTOP while idle: no step starts, no ping is answered
    pings = engine.pings
    ticks, reason = _ticks_until_verdict(watch, engine, 500)
    # The first tick after the freeze sends the ping that is never answered; ten missed ticks follow.
    assert ticks == 1 + 10 and reason is not None and "no heartbeat" in reason and "10 s" in reason
    assert engine.pings == pings + 1  # one ping waits in a frozen core's pipe, not one per tick


def test_short_timeouts_still_get_four_ticks() -> None:
    watch, engine = StallWatch(1.0), FakeEngine()
    assert (watch.interval_s, watch.max_missed) == (0.25, 4)
    engine.answering = False
    assert _ticks_until_verdict(watch, engine, 100)[0] == 5  # the first tick sends the ping; 4 misses follow


def test_ticks_are_counted_not_seconds() -> None:
    # The front end itself was held (its event loop busy for 1000 s); the core's answer is still in
    # the pipe at the first tick after. One missed tick, no verdict on time nobody could watch.
    watch, engine = StallWatch(10.0), FakeEngine()
    assert watch.tick(engine, now=0.0) is None
    engine.answering = False
    assert watch.tick(engine, now=1.0) is None  # this ping is answered late
    assert watch.tick(engine, now=1001.0) is None and watch.missed == 1
    engine.deliver()
    engine.answering = True
    assert watch.tick(engine, now=1002.0) is None and watch.missed == 0


def test_a_running_step_is_judged_by_the_step_clock_alone() -> None:
    watch, engine = StallWatch(10.0), FakeEngine()
    engine.answering = False  # a long step: pings wait for it to end
    engine.step_started_at = 0.0
    for now in range(1, 11):
        assert watch.tick(engine, now=float(now)) is None and watch.missed == 0
    reason = watch.tick(engine, now=10.5)
    assert reason is not None and "step has not returned" in reason


def test_a_loading_engine_is_not_pinged() -> None:
    watch, engine = StallWatch(1.0), FakeEngine()
    engine.is_ready = False  # the core reads Go, then loads: it answers nothing until Ready
    assert _ticks_until_verdict(watch, engine, 1000) == (1000, None)
    assert engine.pings == 0


class _IdleEngine:
    def has_unfinished_requests(self) -> bool:
        return False

    def stats(self) -> str:
        return "stats"


def test_the_core_answers_a_ping_between_steps_and_sends_no_stats_for_it() -> None:
    front, back = multiprocessing.Pipe(duplex=True)
    core = EngineCore(_IdleEngine(), back, multiprocessing.Value("d", 0.0, lock=False))
    front.send(p.Ping(7))
    front.send(p.Shutdown())
    core.run()  # returns at Shutdown
    answers = []
    while front.poll(0):
        answers.append(front.recv())
    assert answers == [p.Pong(7)]


def test_the_in_memory_channel_reads_like_a_pipe() -> None:
    front, back = duplex()
    assert not back.poll(0)
    front.send(p.Ping(1))
    front.send(p.Ping(2))
    assert back.poll(0) and back.poll(0)  # polling twice takes nothing away
    assert back.recv() == p.Ping(1)
    front.close()  # what was sent before the close is still read, then the end
    assert back.recv() == p.Ping(2)
    for _ in range(2):
        assert back.poll(0)
        with pytest.raises(EOFError):
            back.recv()
    with pytest.raises(OSError):
        back.send(p.Pong(1))
    with pytest.raises(EOFError):
        front.recv()  # a closed end's own reader sees the end too


def test_the_same_loop_on_a_thread_answers_pings_and_ends_when_the_front_end_goes() -> None:
    front, back = duplex()
    core = EngineCore(_IdleEngine(), back, ThreadStepClock())
    front.send(p.Ping(3))
    thread = threading.Thread(target=core.run, daemon=True)
    thread.start()
    assert front.poll(PATIENCE_S) and front.recv() == p.Pong(3)
    front.close()
    thread.join(PATIENCE_S)
    assert not thread.is_alive()


# ---- real servers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("frozen-core-model") / "demo", size="tiny")


async def _stream(session: aiohttp.ClientSession, url: str) -> str:
    """How a stream ended: "completed", "error:<code>", "status:<status>:<code>" or "silent-cut"."""
    code = None
    try:
        async with session.post(f"{url}/v1/completions", json={**BODY, "stream": True}) as resp:
            if resp.status != 200:
                return f"status:{resp.status}:{(await resp.json()).get('error', {}).get('code')}"
            async for raw in resp.content:
                code = stream_error_code(raw) or code
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return "silent-cut"
    return "completed" if code is None else f"error:{code}"


async def _plain(session: aiohttp.ClientSession, url: str) -> tuple[int, str | None]:
    async with session.post(f"{url}/v1/completions", json=BODY) as resp:
        return resp.status, (await resp.json()).get("error", {}).get("code")


def _clients_during_freeze(url: str) -> tuple[list[str], list[tuple[int, str | None]]]:
    """Two streams and two plain requests sent to a frozen engine; how each was answered."""
    async def scenario() -> tuple[list[str], list[tuple[int, str | None]]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PATIENCE_S)) as session:
            streams = [asyncio.create_task(_stream(session, url)) for _ in range(2)]
            plain = [asyncio.create_task(_plain(session, url)) for _ in range(2)]
            return list(await asyncio.gather(*streams)), list(await asyncio.gather(*plain))

    return asyncio.run(scenario())


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _resume_and_kill(pid: int, parent: int) -> None:
    """SIGCONT then SIGKILL ``pid`` if it is still ``parent``'s child (never a reused pid)."""
    if _parent_of(pid) != parent:
        return
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


def _assert_answered_and_dead(url: str, outcomes: tuple[list[str], list[tuple[int, str | None]]]) -> None:
    streams, plain = outcomes
    assert all(s in DEAD for s in streams), streams
    assert all(answer == (503, "engine_dead") for answer in plain), plain
    for probe in ("/health", "/ready"):
        reply = http("GET", url + probe)
        assert reply.status == 503 and reply.json()["status"] == "dead", reply.text
        assert "heartbeat" in reply.json()["reason"], reply.text


@pytest.fixture
def process_server(model_dir: Path) -> Iterator[LiveServer]:
    settings = ServerSettings(model_name=MODEL_NAME, engine_stall_timeout_s=STALL_S)
    live = LiveServer(model_dir, CONFIG, settings, engine_process=True).start()
    pid = live.app[STATE].engine.pid
    try:
        yield live
    finally:
        assert pid is not None
        _resume_and_kill(pid, os.getpid())
        live.stop()


def test_a_core_stopped_while_idle_is_declared_dead_and_every_client_answered(process_server: LiveServer) -> None:
    engine = process_server.app[STATE].engine
    assert http("GET", process_server.url + "/health").status == 200
    pid = engine.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # idle: no step in progress, the step clock reads 0
    outcomes = _clients_during_freeze(process_server.url)
    _assert_answered_and_dead(process_server.url, outcomes)
    assert "no heartbeat" in (engine.dead_reason or "")
    assert process_server.app[STATE].dead.is_set()  # what makes `inflight serve` exit 1
    assert _parent_of(pid) is None  # the frozen core was killed (and reaped), as a stalled one is


def test_an_engine_thread_held_between_steps_is_declared_dead_too(model_dir: Path) -> None:
    settings = ServerSettings(model_name=MODEL_NAME, engine_stall_timeout_s=STALL_S)
    live = LiveServer(model_dir, CONFIG, settings).start()
    gate, held = threading.Event(), threading.Event()

    def hold() -> None:
        with live.app[STATE].engine.between_steps():
            held.set()
            gate.wait()

    try:
        # The loop held between two steps, and never let go: the thread's own freeze.
        threading.Thread(target=hold, daemon=True).start()
        assert held.wait(PATIENCE_S)
        outcomes = _clients_during_freeze(live.url)
        _assert_answered_and_dead(live.url, outcomes)
    finally:
        gate.set()
        live.stop()


def test_inflight_serve_exits_1_when_its_core_freezes_while_idle(model_dir: Path) -> None:
    server = ServeProcess(["--model", str(model_dir), "--served-model-name", MODEL_NAME, "--port", "0",
                           "--max-num-sequences", "2", "--num-kv-blocks", "64", "--max-model-len", "256",
                           "--engine-stall-timeout", str(STALL_S)])
    core: int | None = None
    try:
        server.wait_ready()
        core = int(server.log().split("engine core (pid ", 1)[1].split(")", 1)[0])
        os.kill(core, signal.SIGSTOP)
        streams, plain = _clients_during_freeze(server.url)
        code = server.proc.wait(PATIENCE_S)  # patience only: a server that stays up fails here
    finally:
        if core is not None:
            _resume_and_kill(core, server.proc.pid)
        server.stop()
    assert all(s in DEAD for s in streams), (streams, server.log())
    assert all(answer == (503, "engine_dead") for answer in plain), plain
    assert code == 1, server.log()
    assert "no heartbeat" in server.log() and "engine dead" in server.log()
    assert _parent_of(core) != server.proc.pid  # no stopped core left behind
