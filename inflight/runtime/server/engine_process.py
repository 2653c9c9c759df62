"""The engine in a process of its own (the default for ``inflight serve``), seen from the front end.

:class:`CoreProcess` is the spawned engine-core process
(:mod:`inflight.runtime.engine_core.core`); ``inflight serve`` starts it first and takes what
its checks of the model need from it (:meth:`CoreProcess.served_facts`), so torch and
transformers' config classes are imported there only, and it loads nothing until told to.
:class:`ProcessEngine` starts it (or adopts it started), sends it :class:`Go`, and talks to it
over a pipe as every :class:`~.core_client.CoreClient` does; the step clock is a shared double.
The step loop thus never shares a GIL with HTTP, parsing, templates, detokenized text on the
wire or metrics.

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
import logging
import multiprocessing
from collections.abc import Callable
from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.input_checks import check_request
from inflight.runtime.engine_core import protocol as p
from inflight.runtime.engine_core.core import CoreLaunch, run_core
from inflight.runtime.engine_core.served_facts import ServedFacts
from inflight.runtime.outputs import EngineStats
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server.core_client import STOP_TIMEOUT_S, CoreClient
from inflight.runtime.server.engine_client import DEFAULT_MAX_BACKLOG

logger = logging.getLogger("inflight.server.engine")

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


class ProcessEngine(CoreClient):
    """The front end's handle on an engine-core process. Create on the event loop."""

    core_name = "the engine core process"

    def __init__(
        self,
        core: CoreLaunch | CoreProcess,
        on_step: Callable[[EngineStats], None] | None = None,
        on_death: Callable[[str], None] | None = None,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
    ) -> None:
        self._core = core if isinstance(core, CoreProcess) else CoreProcess(core)
        super().__init__(self._core.conn, self._core.step_clock, on_step, on_death, max_backlog)

    @property
    def pid(self) -> int | None:
        return self._core.process.pid

    def _start_core(self) -> None:
        if not self._core.started:
            self._core.start()
        self._outbox.put(p.Go())  # first on the pipe: the writer thread sends in order

    def _join(self, timeout: float) -> None:
        self._core.process.join(timeout)

    def kill(self) -> None:
        """End the core process now if it still runs (a stalled or dying engine)."""
        self._core.kill()

    def _core_ended(self) -> str:
        self._core.process.join(STOP_TIMEOUT_S)
        return f"exit code {self._core.process.exitcode}"

    def _on_prewarmed(self, message: p.Prewarmed) -> None:  # a core started here, not checked by the CLI
        self._core.prewarmed = message

    def _summary_changed(self, summary: p.EngineSummary) -> None:
        assert isinstance(self._view, CoreView)
        self._view.summary = summary

    async def _make_view(self, summary: p.EngineSummary) -> CoreView:
        """The tokenizer and grammar compiler of the front end, built off the event loop."""
        from inflight.runtime.tokenizer import load_tokenizer

        tokenizer = self._core.tokenizer
        if tokenizer is None:  # a core this engine started: nothing checked the model here
            tokenizer = await asyncio.to_thread(load_tokenizer, self._core.launch.model_dir,
                                                self._core.tokenizer_class)
        return await asyncio.to_thread(CoreView, summary, tokenizer)
