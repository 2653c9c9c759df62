"""Run one server process: bind, load the model with progress, serve, drain on SIGTERM, exit.

Owns the process lifecycle: the HTTP port opens first (so /health answers and /ready says
503 while the model loads), SIGTERM / SIGINT / SIGHUP start a drain (new requests 503, requests in
flight finish up to the drain timeout; one log line says so, and for Ctrl-C that pressing it
again exits now), then the runner and the engine core stop and ``serve`` returns the exit
code (0 after a drain, 1 when loading failed). A second SIGTERM or SIGINT exits at once
(``os._exit``, code 128 + signal). When the engine dies or stalls,
every waiting client has already been answered (503 or a stream error event); ``serve``
gives those answers a moment to leave, then exits with code 1 through ``os._exit``, since a
stalled engine thread (``--single-process``) might never let the interpreter finish. One start-up line states the
sampling defaults requests get (``--generation-config``) and the logprobs ceiling. The runner
applies ``ServerSettings.connection_limits`` (``transport``), with the soft open-file limit first
raised to fit ``--max-connections``. With ``--api-server-count N`` this process is front end 0:
it binds the port, spawns and supervises the others (:mod:`.front_ends`), forwards the drain to
them and exits non-zero when any of them did; a spawned front end runs the same ``serve`` and
leaves every decision to front end 0. Knows nothing about argument parsing (``cli``) or request
handling (``app``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from inflight.runtime.engine_core.core import CoreLaunch
from inflight.runtime.engine_core.process_gc import settle_for_serving
from inflight.runtime.logs import AccessLog
from inflight.runtime.server import event_loop
from inflight.runtime.server.app import CUT_GRACE_S, FRONT_ENDS_READY, create_app, drain
from inflight.runtime.server.core_client import CoreClient
from inflight.runtime.server.engine_process import CoreLink, CoreProcess
from inflight.runtime.server.front_ends import (
    Address,
    FrontEndGroup,
    FrontEndLaunch,
    Spawned,
    addresses_of,
    backlog_capped_note,
    bind_listeners,
    exit_front_end,
    listen_backlog,
    start_front_end,
)
from inflight.runtime.server.state import STATE, ServerSettings
from inflight.runtime.server.transport import make_runner

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

logger = logging.getLogger("inflight.server")
ReadyCheck = Callable[[Any], str | None]  # the loaded engine -> a warning to log, or None
FLUSH_TIMEOUT_S = 10.0
FD_RESERVE = 256  # open files besides client connections: the engine pipes, model files, logs
DEATH_ANSWER_S = 2.0  # after an engine death: time for the 503s and error events to leave
EXIT_ENGINE_DEAD = 1
# Each starts a drain; SIGHUP too (a closed terminal or a supervisor's reload must not kill
# requests in flight without one).
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def serve(
    settings: ServerSettings, source: Callable[[], LLMEngine] | CoreLaunch | CoreProcess | CoreLink, host: str,
    port: int, access_log: AccessLog = AccessLog(), spawned: Spawned | None = None,
    ready_checks: Sequence[ReadyCheck] = (), own_process: bool = False,
) -> int:
    """Serve until SIGTERM / SIGINT / SIGHUP; return the process exit code. ``source`` and
    ``access_log``: see :func:`~.app.create_app`. ``settings.api_server_count`` > 1: this is front
    end 0 of several (``source`` the started :class:`CoreProcess`, which has a pipe for each); it
    binds ``host:port`` and spawns the others (:mod:`.front_ends`), and says ready once they all
    are. ``spawned``: this is one of those (``source`` its :class:`CoreLink`). ``ready_checks``:
    each is given the loaded engine and returns a warning to log (or ``None``), e.g. a flag that
    has no effect on the device the engine chose. ``own_process``: this process serves and
    nothing else (the CLI, a spawned front end), so once ready its garbage collector is settled
    for serving (:func:`~inflight.runtime.engine_core.process_gc.settle_for_serving`)."""
    linked = isinstance(source, CoreLink)
    several = settings.api_server_count > 1 and not linked
    if several and not isinstance(source, CoreProcess):
        raise ValueError("--api-server-count > 1 needs the engine-core process (it cannot run with --single-process)")
    peers = FrontEndGroup(settings.api_server_count if several else 1)
    try:
        return await _serve(settings, source, host, port, access_log, spawned, peers, ready_checks, own_process)
    finally:
        peers.remove_metrics_dir()


async def _serve(
    settings: ServerSettings, source: Callable[[], LLMEngine] | CoreLaunch | CoreProcess | CoreLink, host: str,
    port: int, access_log: AccessLog, spawned: Spawned | None, peers: FrontEndGroup,
    ready_checks: Sequence[ReadyCheck] = (), own_process: bool = False,
) -> int:
    linked = isinstance(source, CoreLink)
    several = peers.count > 1
    if several:
        peers.make_metrics_dir()  # before the app makes its metrics
    app = create_app(settings, source, access_log)
    if several:
        app[FRONT_ENDS_READY] = peers.all_ready
    _ensure_fd_room(settings.connection_limits.max_connections)
    runner = make_runner(app, settings.keepalive_timeout_s, settings.connection_limits)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM,) if linked else DRAIN_SIGNALS  # a spawned front end: front end 0 decides
    for sig in signals:
        loop.add_signal_handler(sig, _on_signal, sig, stop, app, peers, linked)
    watch: asyncio.Task[None] | None = None
    backlog = listen_backlog(settings.connection_limits.max_connections)
    try:
        sockets = bind_listeners(host, port, backlog) if several else spawned.sockets if spawned is not None else None
        if sockets is not None:
            for sock in sockets:
                await web.SockSite(runner, sock, backlog=backlog).start()
        else:
            await web.TCPSite(runner, host, port, backlog=backlog).start()
        capped = None if linked else backlog_capped_note(backlog)
        if capped is not None:
            logger.warning(capped)
        if not linked:
            for address in runner.addresses:
                bound_host, bound_port = address[0], address[1]
                logger.info("listening on http://%s:%d (model %s); loading the model",
                            bound_host, bound_port, settings.model_name)
            _log_request_defaults(settings)
        if several:
            assert isinstance(source, CoreProcess) and sockets is not None
            _spawn_front_ends(peers, source, settings, access_log, addresses_of(sockets))
            watch = loop.create_task(peers.watch(lambda why: _front_end_exited(app, why)))
        code = await _until_stopped(app, stop, spawned.on_ready if spawned is not None else None, ready_checks,
                                    own_process)
        if app[STATE].dead.is_set():
            await app[STATE].wait_idle(DEATH_ANSWER_S)
            await _flush_writes(runner, DEATH_ANSWER_S)
            peers.stopping = True  # they exit next, having answered their own clients: no news
            _kill_engine_process(app)  # the other front ends see it and answer their own clients
            if peers.processes:
                await peers.wait(DEATH_ANSWER_S + FLUSH_TIMEOUT_S)
            _exit_now(EXIT_ENGINE_DEAD, f"engine dead: {app[STATE].engine.dead_reason}; exiting", peers)
        await _flush_writes(runner, FLUSH_TIMEOUT_S)
        if peers.processes:  # they drain as this one did; the core ends once the last has left
            peers.terminate()
            drain_s = settings.drain_timeout_s + 2 * CUT_GRACE_S + FLUSH_TIMEOUT_S
            code = max(code, await peers.wait(drain_s))
    finally:
        if watch is not None:
            watch.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    logger.info("stopped (exit code %d)", code)
    return code


def _spawn_front_ends(peers: FrontEndGroup, core: CoreProcess, settings: ServerSettings, access_log: AccessLog,
                      addresses: list[Address]) -> None:
    """Front ends 1..N-1, each on its own pipe to the core and its own socket on our address."""
    metrics_dir = peers.metrics_dir
    if metrics_dir is None:
        raise RuntimeError("several front ends need their shared metrics directory (FrontEndGroup.make_metrics_dir)")
    launch = core.launch

    def make(link: CoreLink, ready: Any) -> FrontEndLaunch:
        return FrontEndLaunch(settings, link, addresses, access_log, launch.log_level, launch.log_format, metrics_dir,
                              ready)

    peers.spawn(core, make, run_front_end)
    pids = [str(os.getpid()), *(str(process.pid) for process in peers.processes)]
    logger.info("%d front-end processes share the port and the engine core (--api-server-count): pids %s",
                settings.api_server_count, ", ".join(pids))


def run_front_end(launch: FrontEndLaunch) -> None:
    """A spawned front end's entry point: serve until drained (exit 0) or the engine died (1)."""
    spawned = start_front_end(launch)
    exit_front_end(event_loop.run(serve(launch.settings, launch.link, "", 0, launch.access_log, spawned,
                                        own_process=True), launch.settings.event_loop))


def _front_end_exited(app: web.Application, why: str) -> None:
    """A spawned front end exited while the server was not stopping: the server goes down."""
    logger.critical("%s; taking the server down", why)
    app[STATE].engine.declare_dead(why)


def _ensure_fd_room(max_connections: int) -> None:
    """Raise the soft open-file limit so that ``max_connections`` sockets fit beside the
    server's own files (as far as the hard limit allows; a warning says when it does not)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        except (ValueError, OSError):
            raised = soft
        if raised < wanted:
            logger.warning("open-file limit %d leaves room for only about %d connections (--max-connections %d)",
                           raised, max(raised - FD_RESERVE, 0), max_connections)


def _log_request_defaults(settings: ServerSettings) -> None:
    """One line: what requests get for the sampling fields they leave out, and the logprobs ceiling."""
    defaults = settings.sampling_defaults
    ceiling = "none" if settings.max_logprobs == -1 else settings.max_logprobs
    level = logging.WARNING if defaults.ignored else logging.INFO
    logger.log(level, "sampling defaults for fields a request leaves out: %s; max logprobs %s",
               defaults.describe(), ceiling)
    if settings.priority_floor is not None:
        logger.info("requests without --priority-api-key may ask for priority %d or higher (lower is served "
                    "first)", settings.priority_floor)


def _on_signal(sig: signal.Signals, stop: asyncio.Event, app: web.Application, peers: FrontEndGroup,
               linked: bool) -> None:
    if linked:  # a spawned front end: front end 0 forwards one SIGTERM, and kills it to stop at once
        if not stop.is_set():
            stop.set()
            logger.info("front end draining (up to %g s)", app[STATE].settings.drain_timeout_s)
        return
    if stop.is_set():
        peers.kill()
        _kill_engine_process(app)
        _exit_now(128 + sig, f"second {sig.name}: exiting at once without draining", peers)
        return
    stop.set()
    peers.terminate()
    again = "press Ctrl-C again to exit now" if sig == signal.SIGINT else f"a second {sig.name} exits at once"
    logger.warning("%s: draining (up to %g s); %s", sig.name, app[STATE].settings.drain_timeout_s, again)


def _kill_engine_process(app: web.Application) -> None:
    """Before ``os._exit``: an engine-core process (stalled, maybe) must not outlive us."""
    engine = app[STATE].engine
    if isinstance(engine, CoreClient):
        engine.kill()


def _exit_now(code: int, message: str, peers: FrontEndGroup) -> None:
    """Log ``message`` and end the process now, whatever other threads are doing (the shared
    metrics directory of several front ends removed first)."""
    peers.remove_metrics_dir()
    logger.critical("%s (exit code %d)", message, code)
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


async def _flush_writes(runner: web.AppRunner, timeout_s: float) -> None:
    """Wait until response bytes still buffered for slow clients have left the process.

    A drained stream has written its last chunk, but under load a client may not have read
    it yet; exiting before the transport buffers empty would cut that stream short.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        server = runner.server
        connections = server.connections if server is not None else []
        if not any(c.transport is not None and c.transport.get_write_buffer_size() > 0 for c in connections):
            return
        await asyncio.sleep(0.05)
    logger.warning("some response bytes were still unsent after %.1f s", timeout_s)


async def _until_stopped(app: web.Application, stop: asyncio.Event, on_ready: Callable[[], None] | None,
                         ready_checks: Sequence[ReadyCheck] = (), own_process: bool = False) -> int:
    state = app[STATE]
    loaded = asyncio.ensure_future(state.engine.wait_ready())
    stopped = asyncio.ensure_future(stop.wait())
    dead = asyncio.ensure_future(state.dead.wait())
    try:
        await asyncio.wait({loaded, stopped, dead}, return_when=asyncio.FIRST_COMPLETED)
        if loaded.done() and not dead.done():
            if loaded.exception() is not None:
                logger.error("loading the model failed: %s", loaded.exception())
                return 1
            logger.info("ready: model %s loaded and warmed up", state.settings.model_name)
            for check in ready_checks:
                line = check(state.engine.engine)
                if line:
                    logger.warning("%s", line)
            if own_process:
                settle_for_serving()
            if on_ready is not None:
                on_ready()
            await asyncio.wait({stopped, dead}, return_when=asyncio.FIRST_COMPLETED)
        if dead.done():
            return EXIT_ENGINE_DEAD
    finally:
        for future in (loaded, stopped, dead):
            future.cancel()
    drained = await drain(app, state.settings.drain_timeout_s)
    logger.info("drain %s", "complete" if drained else "timed out; aborted the rest")
    return 0
