"""The engine-core process: the step loop alone in a process, fed over a pipe.

:func:`run_core` is the process's entry point (spawned by the front end,
:mod:`inflight.runtime.server.engine_process`). It imports the engine and reads what the
start-up checks need (``served_facts``: seconds of torch and transformers imports the front
end thus never makes) at once and sends them in :class:`Prewarmed`, waits for :class:`Go` (a
start the front end refuses ends here, having loaded and logged nothing), then loads and
warms the engine (a problem it sent in :class:`Prewarmed` is its :class:`LoadFailed`), sends
:class:`Ready` with the engine summary, then loops: apply every message waiting on the pipe
(add groups, aborts, retunes), admit groups whose grammars finished compiling (compiles run
on the structured-output manager's worker threads, never on the step loop), run one step and
send its outputs and stats in one :class:`StepDone`. Idle, it blocks on the pipe.

It writes ``time.monotonic()`` into a shared double while a step runs (0 between steps), so
the front end's watchdog sees a step that never returns, and answers each :class:`Ping` with
a :class:`Pong` between steps, so the watchdog sees a loop that no longer turns (a core
frozen while idle: SIGSTOP, a hang outside the step). It exits when the front end sends
:class:`Shutdown` or its end of the pipe closes, and dies with its parent
(``PR_SET_PDEATHSIG`` on Linux), taking its tensor-parallel workers with it. A step that
raises a plain ``Exception`` fails the requests in flight (:class:`FailAll`) and the loop
goes on; three in a row, an :class:`EngineFatalError` or any other ``BaseException`` send
:class:`Dead` and end the process with code 1. Knows nothing about HTTP.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from inflight import env_vars
from inflight.runtime.config import EngineConfig
from inflight.runtime.engine_core import protocol as p
from inflight.runtime.engine_faults import FAULT_ENV, parse_fault
from inflight.runtime.logs import configure_logging
from inflight.runtime.outputs import EngineFatalError, FailedSteps, RequestRejectedError

logger = logging.getLogger("inflight.engine_core")

IDLE_WAIT_S = 0.05
FAILED_STEP_BACKOFF_S = 0.01
MAX_FAILED_STEPS_IN_A_ROW = 3
EXIT_DEAD = 1


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


def run_core(conn: Connection, launch: CoreLaunch, step_clock: Any) -> None:
    """The process entry point (see module docstring). ``step_clock``: a shared double."""
    _die_with_parent()
    _name_process()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop (Ctrl-C)
    configure_logging(launch.log_level, launch.log_format)
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
        _send_quietly(conn, p.LoadFailed(prewarmed.problem))
        os._exit(EXIT_DEAD)
    try:
        engine = _load(launch, tokenizer)
    except BaseException as exc:  # noqa: BLE001 - any failure to load is reported, then exit
        _send_quietly(conn, p.LoadFailed(str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"))
        os._exit(EXIT_DEAD)
    conn.send(p.Ready(p.PROTOCOL_VERSION, engine.summary(), engine.stats()))
    core = EngineCore(engine, conn, step_clock)
    try:
        core.run()
    except BaseException as exc:  # noqa: BLE001 - tell the front end why, then go
        logger.critical("the engine core died", exc_info=True)
        _send_quietly(conn, p.Dead(f"the engine core died: {exc!r}"))
        engine.close()
        os._exit(EXIT_DEAD)
    engine.close()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(0)  # nothing left to clean up; the interpreter's teardown of torch takes ~1 s


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


def _load(launch: CoreLaunch, tokenizer: Any) -> Any:
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.core.input_checks import kv_cache_problem
    from inflight.runtime.core.stats_log import start_stats_log

    progress = logging.getLogger("inflight.loading")
    progress.info("engine core (pid %d): loading %s with %s", os.getpid(), launch.model_dir, launch.config.to_dict())
    # Token ids only: the front end detokenizes and applies stop strings (output_text.py).
    engine = LLMEngine.from_model_dir(Path(launch.model_dir), launch.config, progress=progress.info,
                                      detokenize=False, tokenizer=tokenizer)
    refusal = kv_cache_problem(engine)
    if refusal:
        engine.close()
        raise ValueError(refusal)
    engine.warmup()
    if launch.stats_log:
        start_stats_log(engine.stats)
    return engine


class EngineCore:
    """The loop of one engine-core process over one engine and one pipe."""

    def __init__(self, engine: Any, conn: Connection, step_clock: Any) -> None:
        self.engine = engine
        self.conn = conn
        self.step_clock = step_clock
        self._fault = parse_fault(env_vars.read_str(FAULT_ENV) or "")
        self._pending: list[_PendingGroup] = []
        self._failures = FailedSteps(MAX_FAILED_STEPS_IN_A_ROW)

    def run(self) -> None:
        """Until :class:`Shutdown` or the front end's end of the pipe closes."""
        while True:
            busy = self.engine.has_unfinished_requests() or self._pending
            if not busy:
                self.conn.poll(IDLE_WAIT_S)
            if not self._apply_messages():
                return
            self._admit_compiled()
            if self.engine.has_unfinished_requests():
                self._step()

    # ---- messages ---------------------------------------------------------------------

    def _apply_messages(self) -> bool:
        """Apply every waiting message; False to stop."""
        changed = False
        while self.conn.poll(0):
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                logger.warning("the front end went away; the engine core exits")
                return False
            if isinstance(message, p.Shutdown):
                return False
            if isinstance(message, p.Ping):  # the heartbeat: not a command, no Stats for it
                self.conn.send(p.Pong(message.seq))
                continue
            self._apply(message)
            changed = True
        if changed:
            self.conn.send(p.Stats(self.engine.stats()))
        return True

    def _apply(self, message: object) -> None:
        if isinstance(message, p.AddGroup):
            compiles = [self.engine.structured.submit(r.params.structured)
                        for r in message.requests if r.params.structured is not None]  # fmt: skip
            self._pending.append(_PendingGroup(message, compiles))
        elif isinstance(message, p.Abort):
            self._abort(message.req_ids)
        elif isinstance(message, p.Retune):
            try:
                self.engine.update_config(**message.changes)
            except ValueError as exc:
                self.conn.send(p.RetuneDone(message.call_id, None, str(exc)))
            else:  # the new figures first: whoever waits on the answer then reads them in /metrics
                self.conn.send(p.Stats(self.engine.stats()))
                self.conn.send(p.RetuneDone(message.call_id, self.engine.summary()))
        else:
            raise TypeError(f"unknown message {type(message).__name__} on the engine-core pipe")

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
        message = group.message
        for future in group.compiles:
            exc = future.exception()
            if exc is not None:
                self.conn.send(p.Refused(message.group_id, RequestRejectedError(str(exc), "invalid_request")))
                return
        try:
            self.engine.add_requests(message.requests)
        except RequestRejectedError as exc:
            self.conn.send(p.Refused(message.group_id, exc))
            return
        self.conn.send(p.Admitted(message.group_id))

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
            self.conn.send(p.FailAll(reason))
            time.sleep(FAILED_STEP_BACKOFF_S)
            return
        finally:
            self.step_clock.value = 0.0
        self._failures.succeeded()
        self.conn.send(p.StepDone(tuple(outputs), self.engine.stats()))


def _send_quietly(conn: Connection, message: object) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass


PROCESS_NAME = b"inflight-core"  # what ps, top and /proc/PID/comm show for this process


PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # prctl(2) options


def _prctl(option: int, value: object) -> bool:
    """Linux's prctl(2) through libc; False where there is none (not Linux, no libc symbol)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):
        return False
    return True


def _name_process() -> None:
    """Linux: name the process (and the threads it starts, which inherit the name) so that ps,
    top and the bench's process report tell it from the front end; best effort."""
    _prctl(PR_SET_NAME, ctypes.c_char_p(PROCESS_NAME))


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the front end dies, however it dies (no orphaned core)."""
    if sys.platform.startswith("linux") and not _prctl(PR_SET_PDEATHSIG, signal.SIGKILL):
        logger.warning("could not ask to die with the front end (prctl); an orphan would exit at its next pipe read")
