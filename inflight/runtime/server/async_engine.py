"""Run the engine's step loop in a thread of this process (``--single-process``, and tests).

Owns the engine thread: it loads the model, warms it up, then loops (run queued commands,
``engine.step()``, hand the outputs to the event loop with ``call_soon_threadsafe``). Every
engine method except ``stats``/``encode_prompt``/``validate_request`` runs on that thread,
so the event loop never waits on the model. Commands (add a group of requests, abort,
update the config) go through a thread-safe queue and are applied between steps; an abort
therefore takes effect at the next step and frees the request's KV blocks there.

Failure handling: a step that raises a plain ``Exception`` fails the requests in flight and
the loop goes on; an :class:`EngineFatalError`, any other ``BaseException`` escaping the
thread, or :meth:`declare_dead` (the server's stall watchdog) makes the engine *dead* (see
:class:`~.engine_client.EngineClient`). ``step_started_at`` lets the watchdog see a step that
does not return, and a heartbeat is a command like the others (answered between steps), so it
sees a thread stuck between steps too, as it sees a frozen engine-core process. The default server runs the engine in a process of its own instead
(:mod:`.engine_process`); the event-loop side is shared (:mod:`.engine_client`).

Tests inject a death, a stall or slow steps into this thread through
:mod:`inflight.runtime.engine_faults` (an env var).
Knows nothing about HTTP or the OpenAI API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from inflight import env_vars
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine_types import EngineRequest
from inflight.runtime.engine_faults import FAULT_ENV, parse_fault
from inflight.runtime.outputs import EngineFatalError, EngineStats, FailedSteps
from inflight.runtime.server.engine_client import (
    DEFAULT_MAX_BACKLOG,
    BacklogError,
    EngineClient,
    EngineDeadError,
    EngineStepError,
    RequestFailedError,
    RequestGroup,
    RequestsCutError,
)

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

__all__ = [
    "AsyncEngine", "BacklogError", "EngineDeadError", "EngineRequest", "EngineStepError",
    "RequestFailedError", "RequestGroup", "RequestsCutError",
]

logger = logging.getLogger("inflight.server.engine")

IDLE_WAIT_S = 0.05
FAILED_STEP_BACKOFF_S = 0.01
MAX_FAILED_STEPS_IN_A_ROW = 3  # steps that raise a plain Exception; then the engine is dead

EngineFn = Callable[["LLMEngine"], Any]


class AsyncEngine(EngineClient):
    """The engine thread plus the thread-safe queues around it. Create on the event loop."""

    def __init__(
        self,
        loader: Callable[[], LLMEngine],
        on_step: Callable[[EngineStats], None] | None = None,
        on_death: Callable[[str], None] | None = None,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
    ) -> None:
        super().__init__(on_step, on_death, max_backlog)
        self._loader = loader
        self._fault = parse_fault(env_vars.read_str(FAULT_ENV) or "")
        self._commands: queue.SimpleQueue[tuple[EngineFn, concurrent.futures.Future[Any] | None]]
        self._commands = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._engine: LLMEngine | None = None
        self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)
        self._step_started_at: float | None = None
        self._failures = FailedSteps(MAX_FAILED_STEPS_IN_A_ROW)

    # ---- event-loop side -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def engine(self) -> LLMEngine:
        """The loaded engine, for the thread-safe methods (stats, encode_prompt, ...)."""
        if self._engine is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._engine

    @property
    def step_started_at(self) -> float | None:
        return self._step_started_at

    def stats(self) -> EngineStats | None:
        return self._engine.stats() if self._engine is not None else None

    async def call(self, fn: EngineFn) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._stopping.is_set():
            raise RuntimeError("the engine has stopped")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put((fn, future))
        self._wakeup.set()
        return await asyncio.wrap_future(future)

    async def update_config(self, changes: dict[str, Any]) -> EngineConfig:
        return await self.call(lambda engine: engine.update_config(**changes))

    async def _add(self, requests: Sequence[EngineRequest]) -> None:
        await self.call(lambda engine: engine.add_requests(requests))

    def _abort(self, req_ids: tuple[str, ...]) -> None:
        self._commands.put((lambda engine: [engine.abort_request(r) for r in req_ids], None))
        self._wakeup.set()

    def _send_ping(self, seq: int) -> None:
        self._commands.put((lambda engine: self._answer_ping(seq), None))
        self._wakeup.set()

    def _answer_ping(self, seq: int) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop may be closed already
            self._loop.call_soon_threadsafe(self._pong, seq)

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread.is_alive() and self.dead_reason is None:  # a stalled thread never joins
            await asyncio.to_thread(self._thread.join, timeout)

    def _after_death(self, reason: str) -> None:
        # Commands queued after the thread drained its queue on the way out (or while it is
        # stalled) would never run: answer them here, or their callers wait forever.
        self._fail_commands(EngineDeadError(reason))
        self._stopping.set()
        self._wakeup.set()

    # ---- engine-thread side ----------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._loader()
            engine.warmup()
        except BaseException as exc:  # reported through wait_ready()
            self._loop.call_soon_threadsafe(self._set_ready, exc)
            return
        self._engine = engine
        self._loop.call_soon_threadsafe(self._set_ready, None)
        try:
            self._loop_steps(engine)
        except BaseException as exc:  # noqa: BLE001 - any death of this thread is reported
            logger.critical("the engine thread died", exc_info=True)
            with contextlib.suppress(RuntimeError):  # the event loop may be closed already
                # declare_dead answers the queued commands too (503 engine_dead).
                self._loop.call_soon_threadsafe(self.declare_dead, f"the engine thread died: {exc!r}")
        else:
            self._fail_commands(RuntimeError("the engine has stopped"))
        finally:
            self._step_started_at = None

    def _loop_steps(self, engine: LLMEngine) -> None:
        while not self._stopping.is_set():
            self._wakeup.clear()
            self._run_commands(engine)
            if engine.has_unfinished_requests():
                self._step(engine)
            else:
                self._wakeup.wait(IDLE_WAIT_S)

    def _step(self, engine: LLMEngine) -> None:
        self._step_started_at = time.monotonic()
        try:
            if self._fault is not None:
                self._fault.before_step()
            outputs = engine.step()
        except EngineFatalError:
            raise
        except Exception as exc:
            reason = self._failures.failed(exc)
            logger.exception("engine step failed; failing the requests in flight")
            self._loop.call_soon_threadsafe(self.fail_all, EngineStepError(reason))
            self._stopping.wait(FAILED_STEP_BACKOFF_S)
            return
        finally:
            self._step_started_at = None
        self._failures.succeeded()
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        if self._on_step is not None:
            self._on_step(engine.stats())

    def _run_commands(self, engine: LLMEngine) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(engine)
            except BaseException as exc:
                if future is None:
                    logger.exception("engine command failed")
                else:
                    future.set_exception(exc)
                if isinstance(exc, EngineFatalError) or not isinstance(exc, Exception):
                    raise  # the engine cannot go on: the thread dies and the server with it
            else:
                if future is not None:
                    future.set_result(result)

    def _fail_commands(self, error: BaseException) -> None:
        """Answer every queued command with ``error`` (thread-safe: the queue hands each out once)."""
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)

