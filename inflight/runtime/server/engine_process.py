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
the core is killed if still running.

With ``--api-server-count N`` the core has one pipe per front end: :class:`CoreProcess` makes
them all, front end 0 (this process) keeps the first and hands each other front-end process a
:class:`CoreLink` (its pipe end, the shared step clock, the core's pid). A :class:`ProcessEngine`
on a link did not start the core and does not stop it: its ``Shutdown`` only takes it off the
core, which goes on for the others (it exits when the last one leaves); on a death it does kill
it (a dead or stalled core takes the whole server down). Another front end's retune arrives as
:class:`Retuned`. Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
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
from inflight.runtime.server.lora import LoRAModule

logger = logging.getLogger("inflight.server.engine")

PREWARM_POLL_S = 0.2  # how often a front end waiting for Prewarmed checks the core still runs


class CoreView:
    """The loaded engine as the front end sees it (the ``LLMEngine`` attributes it reads)."""

    def __init__(self, summary: p.EngineSummary, tokenizer: Any) -> None:
        from inflight.runtime.structured.manager import StructuredOutputManager

        self.summary = summary
        self.tokenizer = tokenizer
        # Checks each grammar to refuse a bad or too slow one with a 400 before the request is sent
        # on; keeps verdicts only (the checked grammar text, which the request carries to the core,
        # which only instantiates it and holds the matchers).
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

    def __init__(self, launch: CoreLaunch, num_front_ends: int = 1) -> None:
        if num_front_ends < 1:
            raise ValueError(f"an engine core needs at least one front end (got {num_front_ends})")
        self.launch = launch
        ctx = multiprocessing.get_context("spawn")
        pipes = [ctx.Pipe(duplex=True) for _ in range(num_front_ends)]
        self.conn = pipes[0][0]
        self.peer_conns: list[Connection] = [ours for ours, _ in pipes[1:]]  # for front ends 1..N-1
        self._child_conns = [theirs for _, theirs in pipes]
        self.step_clock = ctx.Value("d", 0.0, lock=False)
        core_conns = self._child_conns if num_front_ends > 1 else self._child_conns[0]
        self.process = ctx.Process(target=run_core, args=(core_conns, launch, self.step_clock),
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
        for conn in self._child_conns:  # the child has its own copies; EOF reaches us when it exits
            conn.close()

    def link(self, index: int) -> CoreLink:
        """What front end ``index`` (1..N-1) needs to reach the started core."""
        if self.process.pid is None:
            raise RuntimeError("start the engine core before linking front ends to it")
        return CoreLink(index, self.peer_conns[index - 1], self.step_clock, self.process.pid,
                        self.launch.model_dir, self.tokenizer_class)

    def release_links(self) -> None:
        """Close this process's copies of the other front ends' pipe ends (once they have theirs),
        so that one that dies closes its connection and the core sees it."""
        for conn in self.peer_conns:
            conn.close()

    def kill(self) -> None:
        """End the process now if it runs (a refused start, a stalled or dying engine)."""
        if self.started and self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_TIMEOUT_S)


@dataclass(frozen=True)
class CoreLink:
    """A front-end process's way to an engine core another process started (picklable only while
    spawning that process: the pipe end and the shared clock travel as file descriptors)."""

    index: int  # the front end's index (1..N-1)
    conn: Connection
    step_clock: Any  # the shared double
    core_pid: int
    model_dir: str
    tokenizer_class: str | None


class ProcessEngine(CoreClient):
    """The front end's handle on an engine-core process. Create on the event loop."""

    core_name = "the engine core process"

    def __init__(
        self,
        core: CoreLaunch | CoreProcess | CoreLink,
        on_step: Callable[[EngineStats], None] | None = None,
        on_death: Callable[[str], None] | None = None,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
        lora_modules: Sequence[LoRAModule] = (),
    ) -> None:
        self._link = core if isinstance(core, CoreLink) else None
        if isinstance(core, CoreLink):  # front end 0 loads --lora-modules; this one asks for the list
            self._core: CoreProcess | None = None
            self.lists_loras_at_ready = True
            super().__init__(core.conn, core.step_clock, on_step, on_death, max_backlog)
            return
        self._core = core if isinstance(core, CoreProcess) else CoreProcess(core)
        super().__init__(self._core.conn, self._core.step_clock, on_step, on_death, max_backlog, lora_modules)

    @property
    def pid(self) -> int | None:
        return self._link.core_pid if self._link is not None else self._process.process.pid

    @property
    def _process(self) -> CoreProcess:
        assert self._core is not None, "a linked front end did not start the core"
        return self._core

    def _start_core(self) -> None:
        if self._link is not None:
            return  # started, and told to load, by front end 0
        if not self._process.started:
            self._process.start()
        self._outbox.put(p.Go())  # first on the pipe: the writer thread sends in order

    def _join(self, timeout: float) -> None:
        if self._link is None:
            self._process.process.join(timeout)
        # linked: the core goes on for the other front ends; front end 0 waits for its exit

    def kill(self) -> None:
        """End the core process now if it still runs (a stalled or dying engine). A linked front
        end kills it only once the engine is dead (a stop just leaves it to the others)."""
        if self._link is None:
            self._process.kill()
        elif self.dead_reason is not None:
            try:
                os.kill(self._link.core_pid, signal.SIGKILL)
            except OSError:  # gone already
                pass

    def _core_ended(self) -> str:
        if self._link is not None:
            return "its connection closed"
        self._process.process.join(STOP_TIMEOUT_S)
        return f"exit code {self._process.process.exitcode}"

    def _on_prewarmed(self, message: p.Prewarmed) -> None:  # a core started here, not checked by the CLI
        if self._core is not None:
            self._core.prewarmed = message

    def _on_message(self, message: object) -> None:
        if isinstance(message, p.Retuned):  # another front end's retune: the same engine, a new summary
            self._summary = message.summary
            self._summary_changed(message.summary)
            return
        super()._on_message(message)

    def _summary_changed(self, summary: p.EngineSummary) -> None:
        if self._view is None:  # not ready here yet: the view is made from the new summary
            return
        assert isinstance(self._view, CoreView)
        self._view.summary = summary

    async def _make_view(self, summary: p.EngineSummary) -> CoreView:
        """The tokenizer and grammar compiler of the front end, built off the event loop."""
        from inflight.runtime.tokenizer import load_tokenizer

        if self._link is not None:
            tokenizer = await asyncio.to_thread(load_tokenizer, self._link.model_dir, self._link.tokenizer_class)
        else:
            tokenizer = self._process.tokenizer
            if tokenizer is None:  # a core this engine started: nothing checked the model here
                tokenizer = await asyncio.to_thread(load_tokenizer, self._process.launch.model_dir,
                                                    self._process.tokenizer_class)
        return await asyncio.to_thread(CoreView, summary, tokenizer)
