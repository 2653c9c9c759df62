"""The engine core: the one step loop, fed protocol messages over a pipe or an in-memory channel.

:class:`EngineCore` is the loop, whichever way it runs: apply every message waiting on its
connection (add groups, aborts, retunes, LoRA calls: :mod:`.lora_calls`, heartbeats), admit groups whose grammars finished
compiling (compiles run on the structured-output manager's worker threads, never on the step
loop), run one step and send its outputs and stats in one :class:`StepDone`. Idle, it blocks on
the connection. It writes ``time.monotonic()`` into a step clock while a step runs (0 between
steps), so the front end's watchdog sees a step that never returns, and answers each
:class:`Ping` with a :class:`Pong` between steps, so the watchdog sees a loop that no longer
turns (a core frozen while idle: SIGSTOP, a hang outside the step). Failure policy, defined here
once: a step that raises a plain ``Exception`` fails the requests in flight (:class:`FailAll`)
and the loop goes on; :data:`MAX_FAILED_STEPS_IN_A_ROW` in a row, an :class:`EngineFatalError`
or any other ``BaseException`` (the test-only fault hook of :mod:`~inflight.runtime.engine_faults`
raises one) send :class:`Dead` and end the loop. Each turn of the loop holds :attr:`EngineCore.turn`.

Two places run it. :func:`run_core` is the engine-core process's entry point (spawned by the front
end, :mod:`inflight.runtime.server.engine_process`): it imports the engine and reads what the
start-up checks need (``served_facts``: seconds of torch and transformers imports the front end
thus never makes) and sends them in :class:`Prewarmed`, waits for :class:`Go` (a start the front
end refuses ends here, having loaded and logged nothing), then loads and warms the engine (a
problem it sent in :class:`Prewarmed` is its :class:`LoadFailed`), sends :class:`Ready` and
runs the loop until :class:`Shutdown` or its pipe closes (with ``--api-server-count N``, one
pipe per front end, :mod:`.routing`: until the last front end has left); it dies with its parent
(``PR_SET_PDEATHSIG`` on Linux), taking its tensor-parallel workers with it, and exits 1 after
:class:`Dead`. :mod:`.inproc` runs the same loop on a thread of the server's process
(``--single-process``, and the tests). Knows nothing about HTTP.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from inflight import env_vars
from inflight.runtime.config import EngineConfig
from inflight.runtime.engine_core import lora_calls
from inflight.runtime.engine_core import protocol as p
from inflight.runtime.engine_core.process_gc import settle_for_serving
from inflight.runtime.engine_core.process_setup import die_with_parent, name_process
from inflight.runtime.engine_core.routing import Conn, FrontEnds
from inflight.runtime.engine_faults import FAULT_ENV, parse_fault
from inflight.runtime.logs import configure_logging, dump_stacks_on_signal
from inflight.runtime.lora.types import UnknownLoRA
from inflight.runtime.outputs import EngineFatalError, FailedSteps, RequestRejectedError

logger = logging.getLogger("inflight.engine_core")

IDLE_WAIT_S = 0.05
FAILED_STEP_BACKOFF_S = 0.01
MAX_FAILED_STEPS_IN_A_ROW = 3  # steps that raise a plain Exception; then the core is dead
EXIT_DEAD = 1


class StepClock(Protocol):
    """Where the loop writes ``time.monotonic()`` of the step in progress (0.0 between steps):
    a shared double across processes, a plain attribute on a thread."""

    value: float


@dataclass(frozen=True, slots=True)
class CoreLaunch:
    """What the front end hands the core process (picklable)."""

    model_dir: str
    config: EngineConfig
    log_level: str = "info"
    log_format: str = "text"
    stats_log: bool = True  # the periodic one-line stats log (``inflight serve`` has it)


@dataclass(slots=True)
class _PendingGroup:
    """A group waiting for its grammars to compile before it is added."""

    message: p.AddGroup
    compiles: list[concurrent.futures.Future[Any]]
    front_end: int = 0  # the index of the front end that sent it


def run_core(conns: Conn | Sequence[Conn], launch: CoreLaunch, step_clock: StepClock) -> None:
    """The process entry point (see module docstring). ``conns``: one connection per front end
    (``--api-server-count``); the start-up handshake (Prewarmed, Go) is front end 0's, Ready or
    LoadFailed goes to all. ``step_clock``: a shared double."""
    die_with_parent()
    name_process(PROCESS_NAME)
    dump_stacks_on_signal()
    # The front end decides when to stop: Ctrl-C, and a SIGTERM sent to the whole process group
    # (systemd's KillMode=control-group, `timeout`), reach it too and start its drain, after which
    # it sends Shutdown; if it dies instead, PR_SET_PDEATHSIG ends this process.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    configure_logging(launch.log_level, launch.log_format)
    front_ends = FrontEnds.of(conns)
    conn = front_ends.first
    prewarmed, tokenizer = _prewarm(launch)
    try:
        conn.send(prewarmed)
        go = conn.recv()
    except (EOFError, OSError):  # the front end refused the start (its checks failed) or went
        os._exit(0)
    if not isinstance(go, p.Go):
        _send_quietly(conn, p.LoadFailed(f"the front end sent {type(go).__name__} before Go: a stale install"))
        os._exit(EXIT_DEAD)
    if prewarmed.problem is not None:  # a front end that did not check (ProcessEngine alone)
        _broadcast_quietly(front_ends, p.LoadFailed(prewarmed.problem))
        os._exit(EXIT_DEAD)
    try:
        engine = load_engine(launch, tokenizer)
        engine.warmup()
        # This process holds one engine for its life: move what loading made (torch,
        # transformers, the model) out of the collector's reach, so that a full collection in
        # the step loop scans only what serving allocates (~0.5 s a full one otherwise), and
        # let a step's temporaries die before the young generation is scanned (engine_core/process_gc.py).
        settle_for_serving()
        if launch.stats_log:
            from inflight.runtime.core.stats_log import start_stats_log

            start_stats_log(engine.stats)
    except BaseException as exc:  # noqa: BLE001 - any failure to load is reported, then exit
        _broadcast_quietly(front_ends, p.LoadFailed(load_failure(exc)))
        os._exit(EXIT_DEAD)
    workers = engine.runner.workers
    if workers is not None:  # a step blocked for good on a dead tensor-parallel worker ends the process
        workers.on_stuck = _exit_stuck
    core = EngineCore(engine, front_ends, step_clock)
    ready = p.Ready(p.PROTOCOL_VERSION, engine.summary(), engine.stats())
    for index in list(front_ends.conns):
        try:
            front_ends.send(index, ready)
        except (OSError, ValueError):  # the one front end went: the loop sees it at once
            break
    died = core.serve("the engine core")
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_DEAD if died else 0)  # nothing left to clean up; the interpreter's teardown of torch takes ~1 s


def _exit_stuck(failure: str) -> None:
    """A tensor-parallel worker died and the step loop is still blocked in a step with it
    (:mod:`~inflight.runtime.distributed.launcher`): exit, as a killed core would; the front end
    sees the pipe close and answers every client (no :class:`Dead` here: the blocked loop may be
    writing to the same pipe)."""
    logger.critical("%s, and the engine thread is still blocked in a step with it; the engine core exits", failure)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(EXIT_DEAD)


def load_failure(exc: BaseException) -> str:
    """The :class:`LoadFailed` line for a load that raised ``exc``."""
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def _prewarm(launch: CoreLaunch) -> tuple[p.Prewarmed, Any]:
    """Import the engine and read the model's facts and tokenizer (transformers' config classes):
    what loading needs before it reads a weight, and what the front end's checks need."""
    try:
        from inflight.runtime.core.engine import LLMEngine  # noqa: F401 - torch and the model code
        from inflight.runtime.engine_core.served_facts import read_served_facts

        facts, tokenizer = read_served_facts(Path(launch.model_dir), launch.config)
    except ValueError as exc:
        return p.Prewarmed(p.PROTOCOL_VERSION, None, str(exc)), None
    except Exception:  # noqa: BLE001 - the front end reads them itself, or the load after Go reports it
        logger.debug("importing and reading the model's facts ahead of the load failed", exc_info=True)
        return p.Prewarmed(p.PROTOCOL_VERSION, None), None
    return p.Prewarmed(p.PROTOCOL_VERSION, facts), tokenizer


def load_engine(launch: CoreLaunch, tokenizer: Any = None) -> Any:
    """The engine a core runs: token ids only (the front end detokenizes and applies stop
    strings, :mod:`.output_text`), refused (``ValueError``) when its KV cache cannot hold one
    request of ``max_model_len``. Not warmed up yet."""
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.core.input_checks import kv_cache_problem

    progress = logging.getLogger("inflight.loading")
    progress.info("engine core (pid %d): loading %s with %s", os.getpid(), launch.model_dir, launch.config.to_dict())
    # Token ids only: the front end detokenizes and applies stop strings (output_text.py).
    engine = LLMEngine.from_model_dir(Path(launch.model_dir), launch.config, progress=progress.info,
                                      tokenizer=tokenizer)
    refusal = kv_cache_problem(engine)
    if refusal:
        engine.close()
        raise ValueError(refusal)
    return engine


class EngineCore:
    """The step loop over one loaded engine and its front ends' connections (see the module
    docstring and :mod:`.routing`: with several, each request's outputs go to the front end
    that added it, stats and failures to all).

    ``turn`` is held for each turn of the loop (messages, admission, one step) and released
    while it waits idle: whoever holds it holds the loop between two steps (the in-process
    client's :meth:`~inflight.runtime.server.engine_inproc.InprocEngine.between_steps`, tests only).
    """

    def __init__(self, engine: Any, conns: Conn | Sequence[Conn] | FrontEnds, step_clock: StepClock) -> None:
        self.engine = engine
        self.front_ends = FrontEnds.of(conns)
        self.step_clock = step_clock
        self.turn = threading.Lock()
        self._fault = parse_fault(env_vars.read_str(FAULT_ENV) or "")
        self._pending: list[_PendingGroup] = []
        self._failures = FailedSteps(MAX_FAILED_STEPS_IN_A_ROW)

    def serve(self, who: str) -> bool:
        """:meth:`run`, then close the engine; True when the loop died (``Dead`` was sent,
        naming ``who``: "the engine core", "the engine thread")."""
        try:
            self.run()
        except BaseException as exc:  # noqa: BLE001 - tell the front ends why, then go
            logger.critical("%s died", who, exc_info=True)
            _broadcast_quietly(self.front_ends, p.Dead(f"{who} died: {exc!r}"))
            self.engine.close()
            return True
        self.engine.close()
        return False

    def run(self) -> None:
        """Until every front end sent :class:`Shutdown` or closed its end of the connection."""
        while True:
            busy = self.engine.has_unfinished_requests() or self._pending
            if not busy:
                self.front_ends.wait(IDLE_WAIT_S)
            with self.turn:
                if not self._apply_messages():
                    return
                self._admit_compiled()
                if self.engine.has_unfinished_requests():
                    self._step()

    # ---- messages ---------------------------------------------------------------------

    def _apply_messages(self) -> bool:
        """Apply every waiting message; False to stop (no front end is left)."""
        changed = False
        for index, conn in self.front_ends.waiting():
            while index in self.front_ends.conns and conn.poll(0):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._drop(index, "went away")
                    changed = True
                    break
                if isinstance(message, p.Shutdown):
                    self._drop(index, "shut down")
                    changed = True
                    break
                if isinstance(message, p.Ping):  # the heartbeat: not a command, no Stats for it
                    self.front_ends.send(index, p.Pong(message.seq))
                    continue
                self._apply(index, message)
                changed = True
        orphans = self.front_ends.orphans()  # of front ends a send found gone
        if orphans:
            logger.warning("a front end went away; aborting its %d request(s)", len(orphans))
            self._abort(orphans)
        self._pending = [g for g in self._pending if g.front_end in self.front_ends.conns]
        if self.front_ends.is_empty:
            return False
        if changed:
            self.front_ends.broadcast(p.Stats(self.engine.stats()))
        return True

    def _drop(self, index: int, how: str) -> None:
        """Front end ``index`` is gone: abort what it added (groups still compiling included)."""
        orphans = self.front_ends.close(index)
        self._pending = [g for g in self._pending if g.front_end != index]
        if self.front_ends.is_empty:
            if how == "went away":
                logger.warning("the front end went away; the engine core exits")
            return
        logger.warning("front end %d %s; aborting its %d request(s), serving the other %d",
                       index, how, len(orphans), len(self.front_ends.conns))
        for req_id in orphans:
            self.engine.abort_request(req_id)

    def _apply(self, index: int, message: object) -> None:
        if isinstance(message, p.AddGroup):
            compiles = [self.engine.structured.submit(r.params.structured)
                        for r in message.requests if r.params.structured is not None]  # fmt: skip
            self._pending.append(_PendingGroup(message, compiles, index))
        elif isinstance(message, p.Abort):
            self.front_ends.forget(message.req_ids)
            self._abort(message.req_ids)
        elif isinstance(message, p.Retune):
            self._retune(index, message)
        elif isinstance(message, p.LoRACall):  # a load or unload failing leaves the batch as it was
            done = lora_calls.answer(self.engine, message)
            if done.error is None and not isinstance(message, p.ListLoRAs):
                self.front_ends.broadcast(p.LoRAsChanged(done.loras), but=index)
            self.front_ends.send(index, done)
        else:
            raise TypeError(f"unknown message {type(message).__name__} on the engine-core pipe")

    def _retune(self, index: int, message: p.Retune) -> None:
        try:
            self.engine.update_config(**message.changes)
        except ValueError as exc:
            self.front_ends.send(index, p.RetuneDone(message.call_id, None, str(exc)))
            return
        # The new figures first: whoever waits on the answer then reads them in /metrics; every
        # other front end gets the new summary too, so all validate against the same config.
        summary = self.engine.summary()
        self.front_ends.broadcast(p.Stats(self.engine.stats()))
        self.front_ends.broadcast(p.Retuned(summary), but=index)
        self.front_ends.send(index, p.RetuneDone(message.call_id, summary))

    def _abort(self, req_ids: tuple[str, ...]) -> None:
        ids = set(req_ids)
        before = len(self._pending)
        self._pending = [g for g in self._pending if not ids & {r.req_id for r in g.message.requests}]
        if len(self._pending) != before:
            logger.debug("aborted %d group(s) still compiling", before - len(self._pending))
        for req_id in req_ids:
            self.engine.abort_request(req_id)

    def _admit_compiled(self) -> None:
        still = []
        for group in self._pending:
            if not all(f.done() for f in group.compiles):
                still.append(group)
                continue
            self._add_group(group)
        self._pending = still

    def _add_group(self, group: _PendingGroup) -> None:
        message, index = group.message, group.front_end
        for future in group.compiles:
            exc = future.exception()
            if exc is not None:
                self.front_ends.send(index, p.Refused(message.group_id,
                                                      RequestRejectedError(str(exc), "invalid_request")))
                return
        try:
            self.engine.add_requests(message.requests)
        except RequestRejectedError as exc:
            self.front_ends.send(index, p.Refused(message.group_id, exc))
            return
        except UnknownLoRA as exc:  # unloaded since the front end resolved the request's model
            error = RequestRejectedError(lora_calls.unknown_message(exc), "model_not_found", "model")
            self.front_ends.send(index, p.Refused(message.group_id, error))
            return
        self.front_ends.own(index, [r.req_id for r in message.requests])
        self.front_ends.send(index, p.Admitted(message.group_id))

    # ---- the step -----------------------------------------------------------------------

    def _step(self) -> None:
        self.step_clock.value = time.monotonic()
        try:
            if self._fault is not None:
                self._fault.before_step()
            outputs = self.engine.step()
        except EngineFatalError:
            raise
        except Exception as exc:
            reason = self._failures.failed(exc)
            logger.exception("engine step failed; failing the requests in flight")
            self.front_ends.broadcast(p.FailAll(reason))
            time.sleep(FAILED_STEP_BACKOFF_S)
            return
        finally:
            self.step_clock.value = 0.0
        self._failures.succeeded()
        stats = self.engine.stats()
        for index, mine in self.front_ends.split(outputs).items():
            self.front_ends.send(index, p.step_done(mine, stats))


def _send_quietly(conn: Conn, message: object) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass


def _broadcast_quietly(front_ends: FrontEnds, message: object) -> None:
    for conn in list(front_ends.conns.values()):
        _send_quietly(conn, message)


PROCESS_NAME = b"inflight-core"  # what ps, top and /proc/PID/comm show for this process
