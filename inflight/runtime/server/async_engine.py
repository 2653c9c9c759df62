"""Run the engine's step loop in its own thread and bridge it to the asyncio event loop.

Owns the engine thread: it loads the model, warms it up, then loops (run queued commands,
``engine.step()``, hand the outputs to the event loop with ``call_soon_threadsafe``). Every
engine method except ``stats``/``encode_prompt``/``validate_request`` runs on that thread,
so the event loop never waits on the model. Commands (add a group of requests, abort,
update the config) go through a thread-safe queue and are applied between steps; an abort
therefore takes effect at the next step and frees the request's KV blocks there.

Failure handling: a request the engine finished with ``finish_reason == "error"`` fails only
its own group (:class:`EngineStepError`); a step that raises a plain ``Exception`` fails the
requests in flight and the loop goes on; an :class:`EngineFatalError`, any other
``BaseException`` escaping the thread, or :meth:`declare_dead` (the server's stall watchdog)
makes the engine *dead*: every waiting group gets :class:`EngineDeadError`, later calls
raise it, and ``on_death(reason)`` tells the server to exit. ``step_started_at`` lets the
watchdog see a step that does not return.

Tests inject a death or a stall of this thread through ``faults`` (an env var).
Knows nothing about HTTP or the OpenAI API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inflight.runtime.outputs import EngineFatalError, EngineStats, RequestOutput
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server.faults import FAULT_ENV, parse_fault

if TYPE_CHECKING:
    from inflight.runtime.engine import LLMEngine

logger = logging.getLogger("inflight.server.engine")

IDLE_WAIT_S = 0.05
FAILED_STEP_BACKOFF_S = 0.01
MAX_FAILED_STEPS_IN_A_ROW = 3  # steps that raise a plain Exception; then the engine is dead
DEFAULT_MAX_BACKLOG = 4096

EngineFn = Callable[["LLMEngine"], Any]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One engine request to add (a client request with ``n`` choices makes ``n`` of these)."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None  # time.monotonic() when the client request arrived


class EngineStepError(RuntimeError):
    """The engine failed on these requests (they were aborted); a server-side fault."""


class RequestFailedError(RuntimeError):
    """The request itself could not go on (e.g. output its grammar could not follow); the
    message is for the client."""


class EngineDeadError(RuntimeError):
    """The engine thread is dead or stalled; the process is about to exit."""


class RequestsCutError(RuntimeError):
    """The server stopped waiting for these requests (the drain timeout expired)."""


class BacklogError(RuntimeError):
    """The client did not read its outputs fast enough; its requests were aborted."""


class RequestGroup:
    """The outputs of one client request's engine requests, in one asyncio queue.

    :meth:`fail` makes the consumer raise at its next read, ahead of buffered outputs.
    """

    def __init__(self, req_ids: Sequence[str]) -> None:
        self.req_ids = tuple(req_ids)
        self._unfinished = set(req_ids)
        self._queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()
        self._error: BaseException | None = None

    def put(self, item: RequestOutput) -> None:
        if item.finished:
            self._unfinished.discard(item.req_id)
        self._queue.put_nowait(item)

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            self._queue.put_nowait(None)  # wake a waiting reader

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    @property
    def unfinished(self) -> tuple[str, ...]:
        return tuple(r for r in self.req_ids if r in self._unfinished)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs in arrival order until every request of the group has finished."""
        pending = len(self.req_ids)
        while pending:
            if self._error is not None:
                raise self._error
            item = await self._queue.get()
            if item is None:
                continue
            if item.finished:
                pending -= 1
            yield item


class AsyncEngine:
    """The engine thread plus the thread-safe queues around it. Create on the event loop."""

    def __init__(
        self,
        loader: Callable[[], LLMEngine],
        on_step: Callable[[LLMEngine], None] | None = None,
        on_death: Callable[[str], None] | None = None,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
    ) -> None:
        self._loader = loader
        self._on_step = on_step
        self._on_death = on_death
        self._max_backlog = max_backlog
        self._fault = parse_fault(os.environ.get(FAULT_ENV, ""))
        self._loop = asyncio.get_running_loop()
        self._commands: queue.SimpleQueue[tuple[EngineFn, concurrent.futures.Future[Any] | None]]
        self._commands = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._groups: dict[str, RequestGroup] = {}  # touched on the event loop only
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._engine: LLMEngine | None = None
        self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)
        self.dead_reason: str | None = None  # set once, on the event loop
        self.step_started_at: float | None = None  # time.monotonic() of the step in progress
        self._failed_steps_in_a_row = 0

    # ---- event-loop side -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    async def wait_ready(self) -> None:
        """Return once the model is loaded and warmed up; raise what loading raised."""
        await asyncio.shield(self._ready)

    @property
    def is_ready(self) -> bool:
        return self._ready.done() and self._ready.exception() is None

    @property
    def engine(self) -> LLMEngine:
        """The loaded engine, for the thread-safe methods (stats, encode_prompt, ...)."""
        if self._engine is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._engine

    def stats(self) -> EngineStats | None:
        return self._engine.stats() if self._engine is not None else None

    @property
    def num_active_groups(self) -> int:
        return len({id(g) for g in self._groups.values()})

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

    def abort(self, req_ids: Sequence[str]) -> None:
        """Abort ``req_ids`` at the next step (frees their KV blocks); does not wait."""
        ids = tuple(req_ids)
        for req_id in ids:
            self._groups.pop(req_id, None)
        self._commands.put((lambda engine: [engine.abort_request(r) for r in ids], None))
        self._wakeup.set()

    @contextlib.asynccontextmanager
    async def generate(self, requests: Sequence[EngineRequest]) -> AsyncIterator[RequestGroup]:
        """Add ``requests`` all or none (raises the engine's rejection), yield their outputs.

        Leaving the block early (error, client gone, cancellation) aborts whatever of the
        group is unfinished.
        """
        group = RequestGroup([r.req_id for r in requests])
        for r in requests:
            self._groups[r.req_id] = group
        try:
            await self.call(lambda engine: _add_all(engine, requests))
        except asyncio.CancelledError:
            self.abort(group.req_ids)
            raise
        except BaseException:
            for r in requests:
                self._groups.pop(r.req_id, None)
            raise
        try:
            yield group
        finally:
            if group.unfinished:
                self.abort(group.unfinished)

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread.is_alive() and self.dead_reason is None:  # a stalled thread never joins
            await asyncio.to_thread(self._thread.join, timeout)

    def fail_all(self, error: BaseException) -> None:
        """Fail every group in flight with ``error`` and abort their requests."""
        groups = {id(g): g for g in self._groups.values()}
        self._groups.clear()
        for group in groups.values():
            group.fail(error)
            if self.dead_reason is None:
                self.abort(group.unfinished)

    def declare_dead(self, reason: str) -> None:
        """Mark the engine dead (event loop side): fail everyone, tell the server once."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.critical("engine dead: %s", reason)
        self.fail_all(EngineDeadError(reason))
        # Commands queued after the thread drained its queue on the way out (or while it is
        # stalled) would never run: answer them here, or their callers wait forever.
        self._fail_commands(EngineDeadError(reason))
        self._stopping.set()
        self._wakeup.set()
        if not self._ready.done():
            self._ready.set_exception(EngineDeadError(reason))
        if self._on_death is not None:
            self._on_death(reason)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            group = self._groups.get(out.req_id)
            if group is None:
                continue  # aborted by its client; nobody is listening
            if out.finished:
                del self._groups[out.req_id]
            if out.finish_reason == "error":
                self._fail_group(group, RequestFailedError(out.error) if out.error else
                                 EngineStepError("the engine failed on this request; see the server log"))
                continue
            group.put(out)
            if group.backlog > self._max_backlog:
                self._fail_group(group, BacklogError(
                    f"more than {self._max_backlog} outputs were waiting for the client to read them"))

    def _fail_group(self, group: RequestGroup, error: BaseException) -> None:
        group.fail(error)
        self.abort(group.unfinished)

    def _set_ready(self, exc: BaseException | None) -> None:
        if self._ready.done():  # declared dead first
            return
        if exc is None:
            self._ready.set_result(None)
        else:
            self._ready.set_exception(exc)

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
            self.step_started_at = None

    def _loop_steps(self, engine: LLMEngine) -> None:
        while not self._stopping.is_set():
            self._wakeup.clear()
            self._run_commands(engine)
            if engine.has_unfinished_requests():
                self._step(engine)
            else:
                self._wakeup.wait(IDLE_WAIT_S)

    def _step(self, engine: LLMEngine) -> None:
        self.step_started_at = time.monotonic()
        try:
            if self._fault is not None:
                self._fault.before_step()
            outputs = engine.step()
        except EngineFatalError:
            raise
        except Exception as exc:
            self._failed_steps_in_a_row += 1
            if self._failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                raise EngineFatalError(f"{self._failed_steps_in_a_row} engine steps in a row failed") from exc
            logger.exception("engine step failed; failing the requests in flight")
            self._loop.call_soon_threadsafe(self.fail_all, EngineStepError(f"engine step failed: {exc!r}"))
            self._stopping.wait(FAILED_STEP_BACKOFF_S)
            return
        finally:
            self.step_started_at = None
        self._failed_steps_in_a_row = 0
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)
        if self._on_step is not None:
            self._on_step(engine)

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


def _add_all(engine: LLMEngine, requests: Sequence[EngineRequest]) -> None:
    """Add every request or none: on a rejection, abort the ones already added and re-raise.

    The whole group is admitted or refused (429) together (``LLMEngine.check_admission``).
    """
    engine.check_admission(len(requests))
    added: list[str] = []
    try:
        for r in requests:
            engine.add_request(
                r.req_id, r.prompt_token_ids, r.params, priority=r.priority, arrival_time=r.arrival_time
            )
            added.append(r.req_id)
    except BaseException:
        for req_id in added:
            engine.abort_request(req_id)
        raise

