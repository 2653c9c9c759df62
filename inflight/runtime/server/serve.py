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
raised to fit ``--max-connections``. Knows nothing about argument parsing (``cli``) or request
handling (``app``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from inflight.runtime.engine_core.core import CoreLaunch
from inflight.runtime.logs import AccessLog
from inflight.runtime.server.app import create_app, drain
from inflight.runtime.server.core_client import CoreClient
from inflight.runtime.server.engine_process import CoreProcess
from inflight.runtime.server.state import STATE, ServerSettings
from inflight.runtime.server.transport import make_runner

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

logger = logging.getLogger("inflight.server")
FLUSH_TIMEOUT_S = 10.0
FD_RESERVE = 256  # open files besides client connections: the engine pipes, model files, logs
DEATH_ANSWER_S = 2.0  # after an engine death: time for the 503s and error events to leave
EXIT_ENGINE_DEAD = 1
# Each starts a drain; SIGHUP too (a closed terminal or a supervisor's reload must not kill
# requests in flight without one).
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


async def serve(
    settings: ServerSettings, source: Callable[[], LLMEngine] | CoreLaunch | CoreProcess, host: str, port: int,
    access_log: AccessLog = AccessLog(),
) -> int:
    """Serve until SIGTERM / SIGINT / SIGHUP; return the process exit code. ``source`` and
    ``access_log``: see :func:`~.app.create_app`."""
    app = create_app(settings, source, access_log)
    _ensure_fd_room(settings.connection_limits.max_connections)
    runner = make_runner(app, settings.keepalive_timeout_s, settings.connection_limits)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in DRAIN_SIGNALS:
        loop.add_signal_handler(sig, _on_signal, sig, stop, app)
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        for address in runner.addresses:
            bound_host, bound_port = address[0], address[1]
            logger.info("listening on http://%s:%d (model %s); loading the model",
                        bound_host, bound_port, settings.model_name)
        _log_request_defaults(settings)
        code = await _until_stopped(app, stop)
        if app[STATE].dead.is_set():
            await app[STATE].wait_idle(DEATH_ANSWER_S)
            await _flush_writes(runner, DEATH_ANSWER_S)
            _kill_engine_process(app)
            _exit_now(EXIT_ENGINE_DEAD, f"engine dead: {app[STATE].engine.dead_reason}; exiting")
        await _flush_writes(runner, FLUSH_TIMEOUT_S)
    finally:
        for sig in DRAIN_SIGNALS:
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    logger.info("stopped (exit code %d)", code)
    return code


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


def _on_signal(sig: signal.Signals, stop: asyncio.Event, app: web.Application) -> None:
    if stop.is_set():
        _kill_engine_process(app)
        _exit_now(128 + sig, f"second {sig.name}: exiting at once without draining")
        return
    stop.set()
    again = "press Ctrl-C again to exit now" if sig == signal.SIGINT else f"a second {sig.name} exits at once"
    logger.warning("%s: draining (up to %g s); %s", sig.name, app[STATE].settings.drain_timeout_s, again)


def _kill_engine_process(app: web.Application) -> None:
    """Before ``os._exit``: an engine-core process (stalled, maybe) must not outlive us."""
    engine = app[STATE].engine
    if isinstance(engine, CoreClient):
        engine.kill()


def _exit_now(code: int, message: str) -> None:
    """Log ``message`` and end the process now, whatever other threads are doing."""
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


async def _until_stopped(app: web.Application, stop: asyncio.Event) -> int:
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
            await asyncio.wait({stopped, dead}, return_when=asyncio.FIRST_COMPLETED)
        if dead.done():
            return EXIT_ENGINE_DEAD
    finally:
        for future in (loaded, stopped, dead):
            future.cancel()
    drained = await drain(app, state.settings.drain_timeout_s)
    logger.info("drain %s", "complete" if drained else "timed out; aborted the rest")
    return 0
