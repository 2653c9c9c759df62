"""The front end's client of an engine core, wherever its loop runs: the protocol messages, spoken.

:class:`CoreClient` talks to one :class:`~inflight.runtime.engine_core.core.EngineCore` over a
connection in the messages of :mod:`inflight.runtime.engine_core.protocol`: a sender thread
writes (so a large prompt never blocks the event loop on a full pipe), a reader thread receives
and hands each message to the event loop. It turns them into what :class:`~.engine_client.EngineClient`
serves: groups added all or none (:class:`AddGroup` -> :class:`Admitted` / :class:`Refused`),
aborts, live retunes, LoRA adapters loaded and unloaded (:class:`LoadLoRA`, :class:`UnloadLoRA` ->
:class:`LoRADone`; the names loaded kept here for resolving a request's ``model``, refreshed by
every answer and by :class:`LoRAsChanged`; ``--lora-modules`` loaded once the core is ready and
before this client says so), each step's token ids detokenized and cut at their stop strings
(:class:`~inflight.runtime.engine_core.output_text.OutputText`; a request stopped here is aborted
in the core), the stats of the last message, the heartbeat (:class:`Ping` / :class:`Pong`) and
the step clock for the watchdog, and death: a :class:`Dead` message, the connection closing, or
the stall watchdog. Subclasses say where the loop runs: :class:`~.engine_process.ProcessEngine`
(a process of its own, behind a pipe) and :class:`~.engine_inproc.InprocEngine` (a thread of
this process, behind an in-memory channel). Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.engine_core import protocol as p
from inflight.runtime.engine_core.core import Conn, StepClock
from inflight.runtime.engine_core.output_text import OutputText
from inflight.runtime.lora.types import LoRAError, LoRAInfo, UnknownLoRA
from inflight.runtime.outputs import EngineStats, RequestOutput
from inflight.runtime.server.engine_client import (
    DEFAULT_MAX_BACKLOG,
    EngineClient,
    EngineDeadError,
    EngineStepError,
    EngineView,
)
from inflight.runtime.server.lora import LoRAModule

STOP_TIMEOUT_S = 10.0


class CoreClient(EngineClient):
    """The event-loop side of one engine core. Create on the event loop.

    Subclasses implement :meth:`_start_core`, :meth:`_join`, :meth:`kill`, :meth:`_core_ended`
    and :meth:`_make_view`, and may override :meth:`_on_prewarmed` and :meth:`_summary_changed`.
    """

    core_name = "the engine core"  # how log lines and death reasons name it
    lists_loras_at_ready = False  # ask the core which adapters are loaded once it is ready

    def __init__(
        self,
        conn: Conn,
        step_clock: StepClock,
        on_step: Callable[[EngineStats], None] | None = None,
        on_death: Callable[[str], None] | None = None,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
        lora_modules: Sequence[LoRAModule] = (),
    ) -> None:
        super().__init__(on_step, on_death, max_backlog)
        self._lora_modules = tuple(lora_modules)  # loaded once ready, before saying so
        self._loras: dict[str, LoRAInfo] = {}
        self._conn = conn
        self._step_clock = step_clock
        self._outbox: queue.SimpleQueue[object | None] = queue.SimpleQueue()
        self._view: EngineView | None = None
        self._summary: p.EngineSummary | None = None
        self._text: OutputText | None = None  # made with the view (it needs the tokenizer)
        self._stats: EngineStats | None = None
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[Any]] = {}  # group / retune id -> its answer
        self._stopping = False

    # ---- where the loop runs (subclasses) -------------------------------------------------

    def _start_core(self) -> None:
        """Start the loop (or adopt it started); runs before the sender and reader threads."""
        raise NotImplementedError

    def _join(self, timeout: float) -> None:
        """Wait (off the event loop) up to ``timeout`` for the loop to end after ``Shutdown``."""
        raise NotImplementedError

    def kill(self) -> None:
        """End the loop now if it still runs, or at least cut it off (a stalled or dead engine)."""
        raise NotImplementedError

    def _core_ended(self) -> str:
        """On the reader thread, once the connection closed: how the core ended ("exit code 1")."""
        raise NotImplementedError

    async def _make_view(self, summary: p.EngineSummary) -> EngineView:
        """What the front end may read of the engine, once it is :class:`Ready`."""
        raise NotImplementedError

    def _on_prewarmed(self, message: p.Prewarmed) -> None:
        """The core's first message, when it sends one (a process does)."""

    def _summary_changed(self, summary: p.EngineSummary) -> None:
        """A retune changed the engine's published summary."""

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._start_core()
        threading.Thread(target=self._read, name="inflight-core-reader", daemon=True).start()
        threading.Thread(target=self._write, name="inflight-core-writer", daemon=True).start()

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._stopping = True
        self._outbox.put(p.Shutdown())
        self._outbox.put(None)
        if self.dead_reason is None:  # a dead core may be stalled: it never ends
            await asyncio.to_thread(self._join, timeout)
        self.kill()

    # ---- what the front end reads ----------------------------------------------------------

    @property
    def engine(self) -> EngineView:
        if self._view is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._view

    @property
    def step_started_at(self) -> float | None:
        return self._step_clock.value or None

    def stats(self) -> EngineStats | None:
        return self._stats

    # ---- commands --------------------------------------------------------------------------

    async def update_config(self, changes: dict[str, Any]) -> EngineConfig:
        done: p.RetuneDone = await self._ask(lambda call_id: p.Retune(call_id, dict(changes)))
        if done.summary is None:
            raise ValueError(done.error or "the engine refused the change")
        self._summary = done.summary
        self._summary_changed(done.summary)
        return done.summary.config

    @property
    def loras(self) -> dict[str, LoRAInfo]:
        return self._loras

    async def load_lora(self, name: str, path: str) -> LoRAInfo:
        done: p.LoRADone = await self._ask(lambda call_id: p.LoadLoRA(call_id, name, path))
        _raise_for(done)
        if done.info is None:
            raise RuntimeError(f"{self.core_name} loaded adapter {name!r} but did not say what it loaded")
        return done.info

    async def unload_lora(self, name: str) -> None:
        _raise_for(await self._ask(lambda call_id: p.UnloadLoRA(call_id, name)))

    async def _load_lora_modules(self) -> None:
        """``--lora-modules``, in order; a refused one fails the start with its reason. A front end
        that did not start the core (:attr:`lists_loras_at_ready`) asks what is loaded instead;
        later changes reach it as :class:`LoRAsChanged`."""
        for module in self._lora_modules:
            try:
                await self.load_lora(module.name, module.path)
            except (LoRAError, RuntimeError) as exc:
                raise RuntimeError(f"--lora-modules {module.name}={module.path}: {exc}") from None
        if self.lists_loras_at_ready:
            _raise_for(await self._ask(p.ListLoRAs))

    async def _add(self, requests: Sequence[p.EngineRequest]) -> None:
        text = self._output_text()
        for r in requests:
            text.add(r.req_id, r.params)
        try:
            answer = await self._ask(lambda group_id: p.AddGroup(group_id, tuple(requests)))
        except BaseException:
            for r in requests:
                text.forget(r.req_id)
            raise
        if isinstance(answer, p.Refused):
            for r in requests:
                text.forget(r.req_id)
            raise answer.error

    def _abort(self, req_ids: tuple[str, ...]) -> None:
        if self._text is not None:
            for req_id in req_ids:
                self._text.forget(req_id)
        self._outbox.put(p.Abort(req_ids))

    def _send_ping(self, seq: int) -> None:
        if not self._stopping:  # after Shutdown the core answers nothing more
            self._outbox.put(p.Ping(seq))

    def _output_text(self) -> OutputText:
        if self._text is None:
            assert self._summary is not None, "requests are added only once the engine is ready"
            self._text = OutputText(self.engine.tokenizer, self._summary.eos_token_ids)
        return self._text

    def _with_text(self, step: p.StepDone) -> list[RequestOutput]:
        """Detokenize the core's token-only outputs; end requests at their stop strings."""
        done, stopped = self._output_text().process_step_done(step)
        if stopped:  # the core keeps computing them until it reads this
            self._outbox.put(p.Abort(stopped))
        return done

    async def _ask(self, make: Callable[[int], object]) -> Any:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        call_id = next(self._ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._waiting[call_id] = future
        self._outbox.put(make(call_id))
        try:
            return await future
        finally:
            self._waiting.pop(call_id, None)

    def _after_death(self, reason: str) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._waiting.clear()
        self._outbox.put(None)
        self.kill()

    # ---- threads ---------------------------------------------------------------------------

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the core is gone; the reader reports it
                return

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            if not self._call_soon(self._on_message, message):
                return
        self._call_soon(self._on_exit, self._core_ended())

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            return False
        return True

    # ---- event-loop side of the messages ---------------------------------------------------

    def _on_message(self, message: object) -> None:
        if isinstance(message, p.StepDone):
            self._stats = message.stats
            self._dispatch(self._with_text(message))
            if self._on_step is not None:
                self._on_step(message.stats)
        elif isinstance(message, p.Stats):
            self._stats = message.stats
        elif isinstance(message, p.Pong):
            self._pong(message.seq)
        elif isinstance(message, (p.Admitted, p.Refused)):
            self._answer(message.group_id, message)
        elif isinstance(message, p.RetuneDone):
            self._answer(message.call_id, message)
        elif isinstance(message, p.LoRADone):
            self._loras = {info.name: info for info in message.loras}
            self._answer(message.call_id, message)
        elif isinstance(message, p.LoRAsChanged):
            self._loras = {info.name: info for info in message.loras}
        elif isinstance(message, p.FailAll):
            self.fail_all(EngineStepError(message.reason))
        elif isinstance(message, p.Prewarmed):
            self._on_prewarmed(message)
        elif isinstance(message, p.Ready):
            self._on_ready(message)
        elif isinstance(message, p.LoadFailed):
            self._set_ready(RuntimeError(message.error))
        elif isinstance(message, p.Dead):
            self.declare_dead(message.reason)

    def _answer(self, call_id: int, message: object) -> None:
        future = self._waiting.get(call_id)
        if future is not None and not future.done():
            future.set_result(message)

    def _on_ready(self, ready: p.Ready) -> None:
        if ready.version != p.PROTOCOL_VERSION:
            self.declare_dead(f"{self.core_name} speaks protocol {ready.version}, this front end "
                              f"{p.PROTOCOL_VERSION}: a stale install")  # fmt: skip
            return
        self._stats = ready.stats
        self._summary = ready.summary
        self._loop.create_task(self._finish_ready(ready.summary))

    async def _finish_ready(self, summary: p.EngineSummary) -> None:
        try:
            self._view = await self._make_view(summary)
            await self._load_lora_modules()
        except Exception as exc:  # noqa: BLE001 - reported through wait_ready()
            self._set_ready(exc)
            self.kill()
            return
        self._set_ready(None)

    def _on_exit(self, ended: str) -> None:
        if self._stopping:
            return
        if not self._ready.done():  # died while loading: wait_ready() reports it
            self._set_ready(RuntimeError(f"{self.core_name} exited while loading ({ended})"))
            return
        if self._ready.exception() is not None:
            return
        self.declare_dead(f"{self.core_name} exited ({ended})")


def _raise_for(done: p.LoRADone) -> None:
    """The engine's exception for a refused LoRA call (none when it succeeded)."""
    if done.error is None:
        return
    if done.error_kind == "refused":
        raise LoRAError(done.error)
    if done.error_kind == "unknown":
        raise UnknownLoRA(done.error)
    raise RuntimeError(done.error)
