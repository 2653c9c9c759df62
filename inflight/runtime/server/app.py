"""The aiohttp application: routes, middlewares, health / readiness / metrics, and drain.

Owns what is common to every route: the OpenAI error shape for every failure (a 500 never
carries a traceback), the inference key for /v1 and the separate admin key for /admin (off
without one), refusing generation with 503 while loading, draining or after the engine died,
counting refused requests in the metrics, counting requests in flight, the access log (one
line per request, refused ones included; ``AccessLog``), naming the request fields a parser
ignored in the ``x-inflight-ignored-fields`` header (logged once per name: ``known_fields``),
the engine watchdog (a step that does not return within the stall timeout, or an idle engine
that answers no heartbeat for as long, kills the engine: :mod:`.watchdog`), and ``drain`` (wait for requests in
flight up to a timeout, then answer the rest with a 503 or a stream error event). It picks the
engine client (an engine-core process, :class:`~.engine_process.ProcessEngine`, for a
``CoreLaunch``; the same core loop on a thread, :class:`~.engine_inproc.InprocEngine`, for a
loader) but knows nothing about how either runs the engine, request schemas (``protocol``) or process signals
(``serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from inflight import __version__
from inflight.runtime.engine_core.core import CoreLaunch
from inflight.runtime.logs import ACCESS_LOGGER, AccessLog, access_record
from inflight.runtime.outputs import EngineStats
from inflight.runtime.server import admin, auth, pooling_api
from inflight.runtime.server.anthropic import routes as anthropic_routes
from inflight.runtime.server.engine_client import EngineClient, EngineDeadError, RequestsCutError
from inflight.runtime.server.engine_inproc import InprocEngine
from inflight.runtime.server.engine_process import CoreLink, CoreProcess, ProcessEngine
from inflight.runtime.server.errors import (
    APIError,
    engine_dead,
    internal_error,
    not_found,
    rejection_reason,
    unavailable,
)
from inflight.runtime.server.metrics import CONTENT_TYPE, ServerMetrics, multiprocess_dir
from inflight.runtime.server.openai import api as openai_api
from inflight.runtime.server.openai import tokenize_api
from inflight.runtime.server.openai.known_fields import (
    IGNORED_FIELDS,
    IGNORED_FIELDS_HEADER,
    IgnoredFieldLog,
    header_value,
)
from inflight.runtime.server.responses_api import routes as responses_routes
from inflight.runtime.server.state import STATE, ServerSettings, ServerState
from inflight.runtime.server.watchdog import StallWatch

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

logger = logging.getLogger("inflight.server")
access_logger = logging.getLogger(ACCESS_LOGGER)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
WATCHDOG = web.AppKey("inflight_watchdog", asyncio.Task)
ACCESS_LOG = web.AppKey("inflight_access_log", AccessLog)
IGNORED_LOG = web.AppKey("inflight_ignored_fields_log", IgnoredFieldLog)
# --api-server-count > 1, front end 0: whether every other front end serves yet (serve sets it)
FRONT_ENDS_READY = web.AppKey("inflight_front_ends_ready", Callable[[], bool])
STATUS_CLIENT_GONE = 499  # the client went away before the answer was complete (as nginx logs it)
FRONT_END_HEADER = "X-Inflight-Front-End"  # with --api-server-count > 1: the index of the front end
CUT_GRACE_S = 5.0  # after a drain timeout: time for cut requests to send their error


def create_app(settings: ServerSettings, source: Callable[[], LLMEngine] | CoreLaunch | CoreProcess | CoreLink,
               access_log: AccessLog = AccessLog()) -> web.Application:
    """A new app. ``source``: a :class:`CoreLaunch` runs the engine in an engine-core process
    of its own (the default of ``inflight serve``, which hands over that process already
    started as a :class:`CoreProcess`); a :class:`CoreLink` reaches a core that front end 0
    started (``--api-server-count``: front ends 1..N-1); a loader (``() -> LLMEngine``, token
    ids only like every engine) runs the same core loop on a thread of this process
    (``--single-process``, and tests that reach into the engine).

    Call inside a running event loop. The engine loads and warms up at startup.
    """
    front_end = source.index if isinstance(source, CoreLink) else 0
    shared = settings.api_server_count > 1
    shared_dir = multiprocess_dir() if shared else None
    if shared and shared_dir is None:
        raise RuntimeError("several front ends need their shared metrics directory (metrics.enable_multiprocess)")
    metrics = ServerMetrics(settings.model_name, lambda: engine.stats(), shared_dir, lambda: engine.engine.max_model_len,
                            lambda: engine.engine.config if engine.is_ready else None)

    def on_step(stats: EngineStats) -> None:
        if front_end == 0:  # every front end sees every step: one counts it
            metrics.observe_step(stats.num_tokens_last_step)

    hooks = dict(
        on_step=on_step,
        on_death=lambda reason: state.dead.set(),
        max_backlog=settings.max_stream_backlog,
        lora_modules=settings.lora_modules,
    )
    engine: EngineClient = (ProcessEngine(source, **hooks) if isinstance(source, (CoreLaunch, CoreProcess, CoreLink))
                            else InprocEngine(source, **hooks))  # fmt: skip
    state = ServerState(settings, engine, metrics)
    app = web.Application(
        middlewares=[*([_access_log] if access_log.enabled else []), _errors, _auth, _admission],
        client_max_size=settings.max_body_bytes + 1,
    )
    app[STATE] = state
    app[ACCESS_LOG] = access_log
    app[IGNORED_LOG] = IgnoredFieldLog(logger)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/version", version)
    openai_api.add_routes(app)
    tokenize_api.add_routes(app)
    pooling_api.add_routes(app)
    responses_routes.add_routes(app)
    anthropic_routes.add_routes(app)
    admin.add_routes(app)
    app.on_response_prepare.append(_name_ignored_fields)
    if shared:  # which front end answered: a client (and a test) can tell them apart
        app.on_response_prepare.append(functools.partial(_name_front_end, str(front_end)))
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    return app


async def _name_front_end(index: str, request: web.Request, response: web.StreamResponse) -> None:
    response.headers[FRONT_END_HEADER] = index


async def _name_ignored_fields(request: web.Request, response: web.StreamResponse) -> None:
    """The request fields the parser ignored (``known_fields.record_ignored``), streamed answers
    included: named in a header, each new name logged once."""
    names = request.get(IGNORED_FIELDS)
    if names:
        response.headers[IGNORED_FIELDS_HEADER] = header_value(names)
        request.app[IGNORED_LOG].warn(names, request.path)


async def _start_engine(app: web.Application) -> None:
    state = app[STATE]
    state.engine.start()
    app[WATCHDOG] = asyncio.get_running_loop().create_task(_watch_engine(state))


async def _stop_engine(app: web.Application) -> None:
    state = app[STATE]
    app[WATCHDOG].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await app[WATCHDOG]
    await state.engine.stop()
    state.close_pool()


async def _watch_engine(state: ServerState) -> None:
    """Declare the engine dead when one step has run longer than the stall timeout, or its loop
    has answered no heartbeat for as long with no step running (:class:`~.watchdog.StallWatch`)."""
    watch = StallWatch(state.settings.engine_stall_timeout_s)
    while state.engine.dead_reason is None:
        await asyncio.sleep(watch.interval_s)
        reason = watch.tick(state.engine, time.monotonic())
        if reason is not None:
            state.engine.declare_dead(reason)


async def drain(app: web.Application, timeout_s: float) -> bool:
    """Refuse new requests (503) and wait up to ``timeout_s`` for those in flight.

    Returns true when all finished in time. Otherwise the rest are cut: streams get an error
    event, non-streaming requests a 503, their engine requests are aborted; returns false.
    """
    state = app[STATE]
    state.draining = True
    logger.info("draining: %d request(s) in flight, up to %.1f s", state.num_in_flight, timeout_s)
    if await state.wait_idle(timeout_s):
        return True
    logger.warning("drain timeout: cutting %d request(s) still in flight", state.num_in_flight)
    state.engine.fail_all(RequestsCutError("the server is shutting down and its drain timeout expired"))
    if await state.wait_idle(CUT_GRACE_S):
        return False
    for task in list(state.tasks):  # e.g. still tokenizing: nothing to answer with yet
        task.cancel()
    await state.wait_idle(CUT_GRACE_S)
    return False


async def health(request: web.Request) -> web.Response:
    reason = request.app[STATE].engine.dead_reason
    if reason is not None:
        return web.json_response({"status": "dead", "reason": reason}, status=503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine.dead_reason is not None:
        return web.json_response({"status": "dead", "reason": state.engine.dead_reason}, status=503)
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not state.engine.is_ready or not request.app.get(FRONT_ENDS_READY, _yes)():
        return web.json_response({"status": "loading"}, status=503)
    return web.json_response({"status": "ready"})


def _yes() -> bool:
    return True


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def metrics_handler(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


@web.middleware
async def _access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One line per request once it is answered (outermost: it sees the status ``_errors`` chose)."""
    started = time.monotonic()
    status = STATUS_CLIENT_GONE
    request_id = request.headers.get("X-Request-Id")
    try:
        response = await handler(request)
        status = response.status
        request_id = response.headers.get("X-Request-Id", request_id)
        return response
    finally:
        path = request.rel_url.raw_path  # no query string: it is the client's, and may hold secrets
        if path not in request.app[ACCESS_LOG].exclude:
            text, fields = access_record(request.method, path, status, (time.monotonic() - started) * 1000, request_id)
            access_logger.info("%s", text, extra={"fields": fields})


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        error = exc
    except EngineDeadError as exc:  # e.g. an admin call after the engine died
        error = engine_dead(exc)
    except web.HTTPException as exc:
        if exc.status == 404:
            error = not_found(f"no route {request.method} {request.path[:200]}")
        else:
            error = APIError(exc.status, exc.reason, "invalid_request_error")
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path[:200])
        error = internal_error()
    if request.method == "POST" and request.path.startswith("/v1/") and request.path not in auth.ADMIN_PATHS:
        reason = rejection_reason(error)
        if reason is not None and reason != "draining":  # draining is counted at admission
            request.app[STATE].metrics.observe_rejected(reason)
    return error.to_response()


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    error = auth.refusal(request, request.app[STATE].settings)
    if error is not None:
        raise error
    return await handler(request)


@web.middleware
async def _admission(request: web.Request, handler: Handler) -> web.StreamResponse:
    """503 for generation while loading or draining; count and track requests in flight."""
    if request.method != "POST" or not request.path.startswith("/v1/"):
        return await handler(request)
    state = request.app[STATE]
    if state.engine.dead_reason is not None:
        raise engine_dead()
    if state.draining:
        state.metrics.observe_rejected("draining")
        raise unavailable("the server is shutting down; retry on another replica", "draining")
    if not state.engine.is_ready:
        raise unavailable("the model is still loading; retry shortly", "loading")
    state.request_started()
    try:
        return await handler(request)
    finally:
        state.request_finished()
