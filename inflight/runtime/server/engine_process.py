"""The engine in a process of its own (the default for ``inflight serve``), seen from the front end.

:class:`CoreProcess` is the spawned engine-core process
(:mod:`inflight.runtime.engine_core.core`); ``inflight serve`` starts it first and takes what
its checks of the model need from it (:meth:`CoreProcess.served_facts`), so torch and
transformers' config classes are imported there only, and it loads nothing until told to.
:class:`ProcessEngine` starts it (or adopts it started), sends it :class:`Go`, and talks to it
over a pipe in the messages of :mod:`inflight.runtime.engine_core.protocol`: a sender thread
writes (so a large prompt never blocks the event loop on a full pipe), a reader thread
receives and hands each message to the event loop. The step loop thus never
shares a GIL with HTTP, parsing, templates, detokenized text on the wire or metrics.

:class:`CoreView` is what the front end may read about the engine: the tokenizer (loaded
here, with the class the core named), the summary the core published (config, vocabulary,
EOS ids, resolved device), prompt validation against it, and a grammar compiler of its own
for early 400s. The watchdog's heartbeat travels as :class:`Ping` / :class:`Pong`. Death: a
:class:`Dead` message, the pipe closing (the core was killed) or the stall watchdog (a step
that never returns, or a core that answers no heartbeat: frozen while idle); on any of them
the core is killed if still running. Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.input_checks import check_request
from inflight.runtime.engine_core import protocol as p
from inflight.runtime.engine_core.core import CoreLaunch, run_core
from inflight.runtime.engine_core.output_text import OutputText
from inflight.runtime.engine_core.served_facts import ServedFacts
from inflight.runtime.outputs import EngineStats, RequestOutput
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server.engine_client import (
    DEFAULT_MAX_BACKLOG,
    EngineClient,
    EngineDeadError,
    EngineStepError,
)

logger = logging.getLogger("inflight.server.engine")

STOP_TIMEOUT_S = 10.0
PREWARM_POLL_S = 0.2  # how often a front end waiting for Prewarmed checks the core still runs


class CoreView:
    """The loaded engine as the front end sees it (the ``LLMEngine`` attributes it reads)."""

    def __init__(self, summary: p.EngineSummary, tokenizer: Any) -> None:
        from inflight.runtime.structured.manager import StructuredOutputManager

        self.summary = summary
        self.tokenizer = tokenizer
        # Compiles to refuse a bad or too slow grammar with a 400 before the request is sent on;
        # keeps verdicts only (the core compiles again and holds the matchers).
        self.structured = StructuredOutputManager(tokenizer, summary.vocab_size, summary.eos_token_ids,
                                                  keep_compiled=False)

    @property
    def config(self) -> EngineConfig:
        return self.summary.config

    @property
    def max_model_len(self) -> int:
        return self.summary.config.max_model_len or 0

    @property
    def vocab_size(self) -> int:
        return self.summary.vocab_size

    @property
    def resolved(self) -> dict[str, str]:
        return self.summary.resolved

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        from inflight.runtime.tokenizer import encode_prompt

        return encode_prompt(self.tokenizer, prompt)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, self.summary.config, self.summary.vocab_size)


class CoreProcess:
    """The engine-core process and the front end's end of its pipe. Started, it imports the
    engine, reads the model's facts and sends them (:class:`Prewarmed`), then waits for
    :class:`Go` before it loads anything.

    Start it from the thread that runs the event loop for the server's whole life:
    ``PR_SET_PDEATHSIG`` in the core fires when the *thread* that spawned it ends."""

    def __init__(self, launch: CoreLaunch) -> None:
        self.launch = launch
        ctx = multiprocessing.get_context("spawn")
        self.conn, self._child_conn = ctx.Pipe(duplex=True)
        self.step_clock = ctx.Value("d", 0.0, lock=False)
        self.process = ctx.Process(target=run_core, args=(self._child_conn, launch, self.step_clock),
                                   name="inflight-engine-core", daemon=False)  # fmt: skip
        self.prewarmed: p.Prewarmed | None = None  # its first message, once received
        self.tokenizer: Any = None  # the model's, when the start-up checks loaded it (the view reuses it)

    @property
    def tokenizer_class(self) -> str | None:
        """The tokenizer class the core's ``AutoTokenizer`` chose, once it said (else None)."""
        facts = self.prewarmed.facts if self.prewarmed is not None else None
        return facts.tokenizer_class if facts is not None else None

    def served_facts(self) -> ServedFacts | None:
        """Wait for the started core's :class:`Prewarmed` (call before :class:`Go`, on the
        thread that will run the server). ``ValueError``: the problem it found in the model,
        its exit, a stale install. None: it could not read them (the caller reads them)."""
        while not self.conn.poll(PREWARM_POLL_S):
            if not self.process.is_alive() and not self.conn.poll():
                break
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self.process.join(STOP_TIMEOUT_S)
            raise ValueError(f"the engine core exited while starting (exit code {self.process.exitcode}); "
                             "its log above says why") from None
        if not isinstance(message, p.Prewarmed) or message.version != p.PROTOCOL_VERSION:
            raise ValueError(f"the engine core spoke another protocol ({message!r:.80}): a stale install")
        self.prewarmed = message
        if message.problem is not None:
            raise ValueError(message.problem)
        return message.facts

    @property
    def started(self) -> bool:
        return self.process.pid is not None

    def start(self) -> None:
        self.process.start()
        self._child_conn.close()  # the child has its own copy; EOF reaches us when it exits

    def kill(self) -> None:
        """End the process now if it runs (a refused start, a stalled or dying engine)."""
        if self.started and self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)


class ProcessEngine(EngineClient):
    """The front end's handle on an engine-core process. Create on the event loop."""

    def __init__(
        self,
        core: CoreLaunch | CoreProcess,
        on_step: Callable[[EngineStats], None] | None = None,
        on_death: Callable[[str], None] | None = None,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
    ) -> None:
        super().__init__(on_step, on_death, max_backlog)
        self._core = core if isinstance(core, CoreProcess) else CoreProcess(core)
        self._outbox: queue.SimpleQueue[object | None] = queue.SimpleQueue()
        self._view: CoreView | None = None
        self._text: OutputText | None = None  # made with the view (it needs the tokenizer)
        self._stats: EngineStats | None = None
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[Any]] = {}  # group / retune id -> its answer
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if not self._core.started:
            self._core.start()
        self._outbox.put(p.Go())  # first on the pipe: the writer thread sends in order
        threading.Thread(target=self._read, name="inflight-core-reader", daemon=True).start()
        threading.Thread(target=self._write, name="inflight-core-writer", daemon=True).start()

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._stopping = True
        self._outbox.put(p.Shutdown())
        self._outbox.put(None)
        await asyncio.to_thread(self._core.process.join, timeout)
        self.kill()

    def kill(self) -> None:
        """End the core process now if it still runs (a stalled or dying engine)."""
        self._core.kill()

    @property
    def pid(self) -> int | None:
        return self._core.process.pid

    # ---- what the front end reads ------------------------------------------------------

    @property
    def engine(self) -> CoreView:
        if self._view is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._view

    @property
    def step_started_at(self) -> float | None:
        started = self._core.step_clock.value
        return started or None

    def stats(self) -> EngineStats | None:
        return self._stats

    # ---- commands ----------------------------------------------------------------------

    async def update_config(self, changes: dict[str, Any]) -> EngineConfig:
        done: p.RetuneDone = await self._ask(lambda call_id: p.Retune(call_id, dict(changes)))
        if done.summary is None:
            raise ValueError(done.error or "the engine refused the change")
        self.engine.summary = done.summary
        return done.summary.config

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
            self._text = OutputText(self.engine.tokenizer, self.engine.summary.eos_token_ids)
        return self._text

    def _with_text(self, outputs: Sequence[RequestOutput]) -> list[RequestOutput]:
        """Detokenize the core's token-only outputs; end requests at their stop strings."""
        text = self._output_text()
        done, stopped = [], []
        for out in outputs:
            processed, stop_here = text.process(out)
            if processed is not None:
                done.append(processed)
            if stop_here:
                stopped.append(out.req_id)
        if stopped:  # the core keeps computing them until it reads this
            self._outbox.put(p.Abort(tuple(stopped)))
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

    # ---- threads -----------------------------------------------------------------------

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._core.conn.send(message)
            except (OSError, ValueError):  # the core is gone; the reader reports it
                return

    def _read(self) -> None:
        while True:
            try:
                message = self._core.conn.recv()
            except (EOFError, OSError):
                break
            self._loop.call_soon_threadsafe(self._on_message, message)
        self._core.process.join(STOP_TIMEOUT_S)
        code = self._core.process.exitcode
        self._loop.call_soon_threadsafe(self._on_exit, code)

    # ---- event-loop side of the messages -----------------------------------------------

    def _on_message(self, message: object) -> None:
        if isinstance(message, p.StepDone):
            self._stats = message.stats
            self._dispatch(self._with_text(message.outputs))
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
        elif isinstance(message, p.FailAll):
            self.fail_all(EngineStepError(message.reason))
        elif isinstance(message, p.Prewarmed):  # a core started here, not checked by the CLI
            self._core.prewarmed = message
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
            self.declare_dead(f"the engine core speaks protocol {ready.version}, this front end "
                              f"{p.PROTOCOL_VERSION}: a stale install")  # fmt: skip
            return
        self._stats = ready.stats
        self._loop.create_task(self._finish_ready(ready.summary))

    async def _finish_ready(self, summary: p.EngineSummary) -> None:
        """The tokenizer and grammar compiler of the front end, built off the event loop."""
        from inflight.runtime.tokenizer import load_tokenizer

        try:
            tokenizer = self._core.tokenizer
            if tokenizer is None:  # a core this engine started: nothing checked the model here
                tokenizer = await asyncio.to_thread(load_tokenizer, self._core.launch.model_dir,
                                                    self._core.tokenizer_class)
            self._view = await asyncio.to_thread(CoreView, summary, tokenizer)
        except Exception as exc:  # noqa: BLE001 - reported through wait_ready()
            self._set_ready(exc)
            self.kill()
            return
        self._set_ready(None)

    def _on_exit(self, code: int | None) -> None:
        if self._stopping:
            return
        if not self._ready.done():  # died while loading: wait_ready() reports it
            self._set_ready(RuntimeError(f"the engine core exited while loading (exit code {code})"))
            return
        if self._ready.exception() is not None:
            return
        self.declare_dead(f"the engine core process exited (exit code {code})")
