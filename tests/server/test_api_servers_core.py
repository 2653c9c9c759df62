"""The engine core with several front ends (``--api-server-count``), on real pipes in one
process and a fake engine: each request's outputs reach only the front end that added it, stats
reach all, a Pong only the pinger, a retune's answer the asker and its new summary every other
front end, a front end that leaves has its requests aborted while the others go on, and the loop
ends when the last one has left. No timing: every wait is a bounded read of a front end's inbox.

Each front end's end is drained by a reader thread into an inbox, as a front-end process's
reader does: the fake engine steps as fast as the loop turns, and a pipe nobody reads fills
in a few hundred steps and blocks the core's send to it (the core then never serves the end
the test is reading: a deadlock a loaded machine hit)."""

from __future__ import annotations

import multiprocessing
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.engine_core import protocol as p
from inflight.runtime.engine_core.core import EngineCore
from inflight.runtime.engine_core.inproc import ThreadStepClock
from inflight.runtime.engine_core.routing import FrontEnds
from inflight.runtime.outputs import EngineStats, RequestOutput
from inflight.runtime.sampling_params import SamplingParams

READ_TIMEOUT_S = 30.0  # patience only


class _Engine:
    """Each request makes one token a step (its count so far) until ``max_tokens``."""

    def __init__(self) -> None:
        self.made: dict[str, int] = {}
        self.limit: dict[str, int] = {}
        self.aborted: list[str] = []
        self.version = 0
        self.closed = False
        self.config = EngineConfig()  # LoRA off: the core reads enable_lora

    def has_unfinished_requests(self) -> bool:
        return bool(self.limit)

    def add_requests(self, requests: Any) -> None:
        for r in requests:
            self.made[r.req_id], self.limit[r.req_id] = 0, r.params.max_tokens

    def abort_request(self, req_id: str) -> None:
        if self.limit.pop(req_id, None) is not None:
            self.aborted.append(req_id)

    def step(self) -> list[RequestOutput]:
        outs = []
        for req_id in list(self.limit):
            self.made[req_id] += 1
            n = self.made[req_id]
            done = n == self.limit[req_id]
            outs.append(RequestOutput(req_id, (n,), "", done, "length" if done else None, 1, n, 0))
            if done:
                del self.limit[req_id]
        return outs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.limit), 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 4 + self.version)

    def summary(self) -> str:  # the real one is an EngineSummary; the loop only passes it on
        return f"summary-v{self.version}"

    def update_config(self, **changes: Any) -> None:
        if "bad" in changes:
            raise ValueError("bad is not a setting")
        self.version += 1

    def close(self) -> None:
        self.closed = True


class _Reader:
    """Drains one front end's end into an inbox on a thread until told to stop or the pipe ends."""

    TICK_S = 0.05  # how often a stopped reader notices it was told to stop (never a bound)

    def __init__(self, end: Connection) -> None:
        self.end = end
        self.inbox: queue.Queue[object] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.end.poll(self.TICK_S):
                    self.inbox.put(self.end.recv())
            except (EOFError, OSError):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(READ_TIMEOUT_S)
        assert not self._thread.is_alive(), "a front end's reader did not stop"


@dataclass
class _Rig:
    engine: _Engine
    ends: list[Connection]  # the front ends' ends, by index
    readers: list[_Reader]  # one per end, by index
    thread: threading.Thread

    def send(self, index: int, message: object) -> None:
        self.ends[index].send(message)

    def leave(self, index: int) -> None:
        """Front end ``index`` dies: it stops reading and its end closes."""
        self.readers[index].stop()
        self.ends[index].close()

    def until(self, index: int, kind: type) -> tuple[list[object], object]:
        """Front end ``index``'s messages up to the first ``kind``: (those before, it)."""
        before = []
        while True:
            try:
                message = self.readers[index].inbox.get(timeout=READ_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"front end {index} got no {kind.__name__}") from None
            if isinstance(message, kind):
                return before, message
            before.append(message)


@pytest.fixture
def rig() -> Iterator[_Rig]:
    pipes = [multiprocessing.Pipe(duplex=True) for _ in range(3)]
    engine = _Engine()
    core = EngineCore(engine, FrontEnds([theirs for _, theirs in pipes]), ThreadStepClock())
    thread = threading.Thread(target=core.serve, args=("the engine core",), daemon=True)
    thread.start()
    ends = [ours for ours, _ in pipes]
    rig = _Rig(engine, ends, [_Reader(end) for end in ends], thread)
    yield rig
    for index in range(len(ends)):
        rig.leave(index)
    thread.join(READ_TIMEOUT_S)


def _group(group_id: int, *req_ids: str, max_tokens: int = 3) -> p.AddGroup:
    params = SamplingParams(max_tokens=max_tokens)
    return p.AddGroup(group_id, tuple(p.EngineRequest(r, [1, 2], params) for r in req_ids))


def _outputs(message: object) -> list[RequestOutput]:
    outs = message.outputs  # type: ignore[attr-defined]
    return list(outs() if callable(outs) else outs)


def _tokens_until_finished(rig: _Rig, index: int, req_ids: set[str]) -> dict[str, list[int]]:
    """Front end ``index``'s tokens of each request, in order, until all of ``req_ids`` finished."""
    tokens: dict[str, list[int]] = {}
    unfinished = set(req_ids)
    while unfinished:
        _, step = rig.until(index, p.StepDone)
        for out in _outputs(step):
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                unfinished.discard(out.req_id)
    return tokens


def test_each_front_end_gets_only_its_own_requests_outputs(rig: _Rig) -> None:
    rig.send(0, _group(7, "a-0", "a-1"))
    rig.send(1, _group(7, "b-0", max_tokens=5))  # the same group id: ids are per front end
    rig.until(0, p.Admitted)
    rig.until(1, p.Admitted)
    assert _tokens_until_finished(rig, 0, {"a-0", "a-1"}) == {"a-0": [1, 2, 3], "a-1": [1, 2, 3]}
    assert _tokens_until_finished(rig, 1, {"b-0"}) == {"b-0": [1, 2, 3, 4, 5]}
    # front end 2 added nothing and got every step's stats, with no outputs
    rig.send(2, p.Ping(1))
    before, pong = rig.until(2, p.Pong)
    steps = [m for m in before if isinstance(m, p.StepDone)]
    assert steps and all(_outputs(m) == [] for m in steps)
    assert pong == p.Pong(1)


def test_pong_goes_to_the_pinger_and_a_retune_to_everyone(rig: _Rig) -> None:
    rig.send(1, p.Ping(5))
    assert rig.until(1, p.Pong)[1] == p.Pong(5)
    rig.send(2, p.Retune(3, {"max_num_sequences": 8}))
    before, done = rig.until(2, p.RetuneDone)
    assert done == p.RetuneDone(3, "summary-v1")
    assert any(isinstance(m, p.Stats) and m.stats.max_num_sequences == 5 for m in before)
    for other in (0, 1):
        before, retuned = rig.until(other, p.Retuned)
        assert retuned == p.Retuned("summary-v1")
        assert not any(isinstance(m, (p.Pong, p.RetuneDone)) for m in before)  # nobody else's answers
    rig.send(0, p.Retune(4, {"bad": 1}))
    assert rig.until(0, p.RetuneDone)[1] == p.RetuneDone(4, None, "bad is not a setting")


def test_a_front_end_that_leaves_has_its_requests_aborted_and_the_others_go_on(rig: _Rig) -> None:
    rig.send(0, _group(1, "a-0", max_tokens=10**6))
    rig.send(1, _group(1, "b-0", max_tokens=10**6))
    rig.until(0, p.Admitted)
    rig.until(1, p.Admitted)
    rig.leave(1)  # as a front-end process that died
    rig.send(2, _group(1, "c-0", max_tokens=2))
    rig.until(2, p.Admitted)
    assert _tokens_until_finished(rig, 2, {"c-0"}) == {"c-0": [1, 2]}
    assert "b-0" in rig.engine.aborted and "a-0" not in rig.engine.aborted
    rig.send(0, p.Abort(("a-0",)))
    rig.send(0, p.Shutdown())  # a front end that stops: the core goes on for the last one
    rig.send(2, p.Ping(9))
    assert rig.until(2, p.Pong)[1] == p.Pong(9)
    assert rig.thread.is_alive()
    rig.send(2, p.Shutdown())
    rig.thread.join(READ_TIMEOUT_S)
    assert not rig.thread.is_alive() and rig.engine.closed
