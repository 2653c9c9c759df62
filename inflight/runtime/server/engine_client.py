"""The front end's side of the engine, whichever way it runs: request groups, dispatch, death.

:class:`EngineClient` owns what lives on the event loop: one :class:`RequestGroup` (a
deque and a waiter) per client request, the dispatch of each step's outputs to their groups,
failing groups (a request the engine failed on fails only its own group; a client too slow to
read its outputs is cut), the heartbeat (:meth:`EngineClient.ping`: the engine's loop answers
between steps and :attr:`~EngineClient.heartbeat` advances, so the watchdog sees an idle engine
that froze), and the engine's death (every waiting group gets :class:`EngineDeadError`,
``on_death(reason)`` tells the server to exit). How requests reach
the engine and outputs come back is a subclass's job: :class:`~.core_client.CoreClient` speaks the
engine core's protocol, to a process of its own (:class:`~.engine_process.ProcessEngine`) or to
the same loop on a thread (:class:`~.engine_inproc.InprocEngine`). Knows nothing about HTTP or
the OpenAI API.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine_types import EngineRequest
from inflight.runtime.lora.types import LoRAInfo
from inflight.runtime.outputs import EngineStats, RequestOutput

logger = logging.getLogger("inflight.server.engine")

DEFAULT_MAX_BACKLOG = 4096

__all__ = ["EngineRequest", "EngineClient", "RequestGroup"]


class EngineView(Protocol):
    """All the front end may read of the engine: ``LLMEngine`` in a thread, ``CoreView`` of
    an engine-core process. Nothing else of the engine is reached from the front end."""

    tokenizer: Any
    structured: Any  # compiles grammars (cached): .submit(StructuredOutputsParams) -> Future

    @property
    def config(self) -> EngineConfig: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def resolved(self) -> dict[str, str]: ...

    def encode_prompt(self, prompt: str | list[int]) -> list[int]: ...

    def validate_request(self, prompt_token_ids: list[int], params: Any) -> None: ...


class EngineStepError(RuntimeError):
    """The engine failed on these requests (they were aborted); a server-side fault."""


class RequestFailedError(RuntimeError):
    """The request itself could not go on (e.g. output its grammar could not follow); the
    message is for the client."""


class EngineDeadError(RuntimeError):
    """The engine is dead or stalled; the process is about to exit."""


class RequestsCutError(RuntimeError):
    """The server stopped waiting for these requests (the drain timeout expired)."""


class BacklogError(RuntimeError):
    """The client did not read its outputs fast enough; its requests were aborted."""


class RequestGroup:
    """The outputs of one client request's engine requests: a deque and one waiter.

    :meth:`put` appends and wakes the reader (once: later puts before it runs find it woken,
    so a step's outputs wake a group once). :meth:`batches` hands the reader every output
    queued since its last read; ``async for out in group`` hands them one by one. :meth:`fail`
    makes the consumer raise at its next read, ahead of buffered outputs.
    """

    def __init__(self, req_ids: Sequence[str]) -> None:
        self.req_ids = tuple(req_ids)
        self._unfinished = set(req_ids)
        self._outputs: collections.deque[RequestOutput] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None

    def put(self, item: RequestOutput) -> None:
        if item.finished:
            self._unfinished.discard(item.req_id)
        self._outputs.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    @property
    def backlog(self) -> int:
        return len(self._outputs)

    @property
    def unfinished(self) -> tuple[str, ...]:
        return tuple(r for r in self.req_ids if r in self._unfinished)

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Every output queued since the last read, in arrival order, one list per wakeup,
        until every request of the group has finished."""
        pending = len(self.req_ids)
        outputs = self._outputs
        while pending:
            if self._error is not None:
                raise self._error
            if not outputs:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
                continue
            batch = list(outputs)
            outputs.clear()
            for out in batch:
                if out.finished:
                    pending -= 1
            yield batch

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs in arrival order until every request of the group has finished."""
        async for batch in self.batches():
            for out in batch:
                if self._error is not None:
                    raise self._error
                yield out


class EngineClient:
    """Event-loop side of the engine. Create on the event loop; subclasses say how to reach it.

    Subclasses implement :meth:`start`, :meth:`stop`, :meth:`stats`, :attr:`engine` (what the
    front end may read: tokenizer, config, validation), :attr:`step_started_at`,
    :meth:`update_config`, the LoRA calls (:meth:`load_lora`, :meth:`unload_lora`, :attr:`loras`), :meth:`_add` (all or none, raising the engine's rejection),
    :meth:`_abort`, :meth:`_send_ping` and :meth:`_after_death`; and call :meth:`_dispatch`,
    :meth:`_set_ready`, :meth:`_pong`, :meth:`fail_all` and :meth:`declare_dead` on the event loop.
    """

    def __init__(
        self,
        on_step: Callable[[EngineStats], None] | None = None,
        on_death: Callable[[str], None] | None = None,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
    ) -> None:
        self._on_step = on_step
        self._on_death = on_death
        self._max_backlog = max_backlog
        self._loop = asyncio.get_running_loop()
        self._groups: dict[str, RequestGroup] = {}  # touched on the event loop only
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self.dead_reason: str | None = None  # set once, on the event loop
        self.heartbeat = 0  # the last heartbeat the engine's loop answered (event loop only)
        self._pings_sent = 0

    # ---- what a subclass provides ------------------------------------------------------

    def start(self) -> None:
        raise NotImplementedError

    async def stop(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    def stats(self) -> EngineStats | None:
        raise NotImplementedError

    @property
    def engine(self) -> EngineView:
        """The loaded engine, as the front end may see it."""
        raise NotImplementedError

    @property
    def step_started_at(self) -> float | None:
        """``time.monotonic()`` when the step in progress started; None between steps."""
        raise NotImplementedError

    async def update_config(self, changes: dict[str, Any]) -> EngineConfig:
        """Apply live-tunable changes between steps; ``ValueError`` for a refused change."""
        raise NotImplementedError

    async def load_lora(self, name: str, path: str) -> LoRAInfo:
        """Load a PEFT adapter between steps: ``LoRAError`` when refused (the reason), ``RuntimeError``
        when the engine failed otherwise; what is loaded already stays as it was."""
        raise NotImplementedError

    async def unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` (requests admitted with it finish with it); ``UnknownLoRA``."""
        raise NotImplementedError

    @property
    def loras(self) -> dict[str, LoRAInfo]:
        """The adapters loaded, by name, as this front end last heard (empty before ready)."""
        raise NotImplementedError

    async def _add(self, requests: Sequence[EngineRequest]) -> None:
        raise NotImplementedError

    def _abort(self, req_ids: tuple[str, ...]) -> None:
        raise NotImplementedError

    def _send_ping(self, seq: int) -> None:
        """Have the engine's loop call :meth:`_pong` with ``seq`` (on the event loop) between steps."""
        raise NotImplementedError

    def _after_death(self, reason: str) -> None:
        """Release what the dead engine holds (answer queued commands, stop a process)."""

    # ---- event-loop side ---------------------------------------------------------------

    async def wait_ready(self) -> None:
        """Return once the model is loaded and warmed up; raise what loading raised."""
        await asyncio.shield(self._ready)

    @property
    def is_ready(self) -> bool:
        return self._ready.done() and self._ready.exception() is None

    def abort(self, req_ids: Sequence[str]) -> None:
        """Abort ``req_ids`` at the next step (frees their KV blocks); does not wait."""
        ids = tuple(req_ids)
        for req_id in ids:
            self._groups.pop(req_id, None)
        if ids and self.dead_reason is None:
            self._abort(ids)

    @contextlib.asynccontextmanager
    async def generate(self, requests: Sequence[EngineRequest]) -> AsyncIterator[RequestGroup]:
        """Add ``requests`` all or none (raises the engine's rejection), yield their outputs.

        Leaving the block early (error, client gone, cancellation) aborts whatever of the
        group is unfinished.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        group = RequestGroup([r.req_id for r in requests])
        for r in requests:
            self._groups[r.req_id] = group
        try:
            await self._add(requests)
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

    def ping(self) -> None:
        """Send the engine's loop the next heartbeat unless the last one is still unanswered (a
        frozen engine gets one, not one per tick); its answer, between two steps, advances
        :attr:`heartbeat`. The watchdog calls this once per tick (:mod:`.watchdog`)."""
        if self.dead_reason is None and self.heartbeat == self._pings_sent:
            self._pings_sent += 1
            self._send_ping(self._pings_sent)

    def _pong(self, seq: int) -> None:
        """The engine's loop answered heartbeat ``seq`` (event loop side)."""
        self.heartbeat = max(self.heartbeat, seq)

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
        self._after_death(reason)
        if not self._ready.done():
            self._ready.set_exception(EngineDeadError(reason))
        if self._on_death is not None:
            self._on_death(reason)

    def _dispatch(self, outputs: Sequence[RequestOutput]) -> None:
        """Hand one step's outputs to their groups: each group's reader wakes once for the
        step (:meth:`RequestGroup.put`) and takes them all at its next read."""
        groups = self._groups
        max_backlog = self._max_backlog
        for out in outputs:
            group = groups.get(out.req_id)
            if group is None:
                continue  # aborted by its client; nobody is listening
            if out.finished:
                del groups[out.req_id]
            if out.finish_reason == "error":
                self._fail_group(group, RequestFailedError(out.error) if out.error else
                                 EngineStepError("the engine failed on this request; see the server log"))
                continue
            group.put(out)
            if group.backlog > max_backlog:
                self._fail_group(group, BacklogError(
                    f"more than {max_backlog} outputs were waiting for the client to read them"))

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
