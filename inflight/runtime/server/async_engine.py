"""Run the engine's step loop in its own thread and bridge it to the asyncio event loop.

Owns the engine thread: it loads the model, warms it up, then loops (run queued commands,
``engine.step()``, hand the outputs to the event loop with ``call_soon_threadsafe``). Every
engine method except ``stats``/``encode_prompt``/``validate_request`` runs on that thread,
so the event loop never waits on the model. Commands (add a group of requests, abort,
update the config) go through a thread-safe queue and are applied between steps; an abort
therefore takes effect at the next step and frees the request's KV blocks there.
Knows nothing about HTTP or the OpenAI API.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inflight.runtime.outputs import EngineStats, RequestOutput
from inflight.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inflight.runtime.engine import LLMEngine

logger = logging.getLogger("inflight.server.engine")

IDLE_WAIT_S = 0.05
FAILED_STEP_BACKOFF_S = 0.01

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
    """The engine raised while stepping; the requests in flight were failed and aborted."""


class RequestGroup:
    """The outputs of one client request's engine requests, in one asyncio queue."""

    def __init__(self, req_ids: Sequence[str]) -> None:
        self.req_ids = tuple(req_ids)
        self._unfinished = set(req_ids)
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput) and item.finished:
            self._unfinished.discard(item.req_id)
        self._queue.put_nowait(item)

    @property
    def unfinished(self) -> tuple[str, ...]:
        return tuple(r for r in self.req_ids if r in self._unfinished)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs in arrival order until every request of the group has finished."""
        pending = len(self.req_ids)
        while pending:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                pending -= 1
            yield item


class AsyncEngine:
    """The engine thread plus the thread-safe queues around it. Create on the event loop."""

    def __init__(
        self,
        loader: Callable[[], LLMEngine],
        on_step: Callable[[LLMEngine], None] | None = None,
    ) -> None:
        self._loader = loader
        self._on_step = on_step
        self._loop = asyncio.get_running_loop()
        self._commands: queue.SimpleQueue[tuple[EngineFn, concurrent.futures.Future[Any] | None]]
        self._commands = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._groups: dict[str, RequestGroup] = {}  # touched on the event loop only
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._engine: LLMEngine | None = None
        self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)

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
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, timeout)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            group = self._groups.get(out.req_id)
            if group is None:
                continue  # aborted by its client; nobody is listening
            group.put(out)
            if out.finished:
                del self._groups[out.req_id]

    def _fail_all(self, exc: BaseException) -> None:
        groups = {id(g): g for g in self._groups.values()}
        self._groups.clear()
        for group in groups.values():
            group.put(EngineStepError(f"engine step failed: {exc!r}"))
            self.abort(group.unfinished)

    def _set_ready(self, exc: BaseException | None) -> None:
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
        while not self._stopping.is_set():
            self._wakeup.clear()
            self._run_commands(engine)
            if engine.has_unfinished_requests():
                self._step(engine)
            else:
                self._wakeup.wait(IDLE_WAIT_S)
        self._fail_commands()

    def _step(self, engine: LLMEngine) -> None:
        try:
            outputs = engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            self._loop.call_soon_threadsafe(self._fail_all, exc)
            self._stopping.wait(FAILED_STEP_BACKOFF_S)
            return
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
            else:
                if future is not None:
                    future.set_result(result)

    def _fail_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the engine has stopped"))


def _add_all(engine: LLMEngine, requests: Sequence[EngineRequest]) -> None:
    """Add every request or none: on a rejection, abort the ones already added and re-raise."""
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
