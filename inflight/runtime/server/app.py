"""The aiohttp application: routes, middlewares, health / readiness / metrics, and drain.

Owns what is common to every route: the OpenAI error shape for every failure (a 500 never
carries a traceback), API-key checks for /v1 and /admin, refusing generation with 503 while
loading or draining, counting requests in flight, and ``drain`` (wait for them, up to a
timeout, then abort the rest). Knows nothing about request schemas (``protocol``), the
engine thread (``async_engine``) or process signals (``serve``).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from inflight import __version__
from inflight.runtime.server import admin, openai_api
from inflight.runtime.server.async_engine import AsyncEngine
from inflight.runtime.server.errors import (
    APIError,
    internal_error,
    not_found,
    unauthorized,
    unavailable,
)
from inflight.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from inflight.runtime.server.state import STATE, ServerSettings, ServerState

if TYPE_CHECKING:
    from inflight.runtime.engine import LLMEngine

logger = logging.getLogger("inflight.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_PROTECTED_PREFIXES = ("/v1/", "/admin/")


def create_app(settings: ServerSettings, loader: Callable[[], LLMEngine]) -> web.Application:
    """A new app whose engine thread runs ``loader()`` then ``warmup()`` at startup.

    Call inside a running event loop. ``loader`` runs on the engine thread.
    """
    metrics = ServerMetrics(settings.model_name, lambda: engine.stats())
    engine = AsyncEngine(loader, on_step=lambda e: metrics.observe_step(e.stats().num_tokens_last_step))
    state = ServerState(settings, engine, metrics)
    app = web.Application(
        middlewares=[_errors, _auth, _admission],
        client_max_size=settings.max_body_bytes + 1,
    )
    app[STATE] = state
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/version", version)
    openai_api.add_routes(app)
    admin.add_routes(app)
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    return app


async def _start_engine(app: web.Application) -> None:
    app[STATE].engine.start()


async def _stop_engine(app: web.Application) -> None:
    await app[STATE].engine.stop()


async def drain(app: web.Application, timeout_s: float) -> bool:
    """Refuse new requests (503) and wait up to ``timeout_s`` for those in flight.

    Returns true when all finished in time; otherwise aborts the rest and returns false.
    """
    state = app[STATE]
    state.draining = True
    logger.info("draining: %d request(s) in flight, up to %.1f s", state.num_in_flight, timeout_s)
    if await state.wait_idle(timeout_s):
        return True
    logger.warning("drain timeout: aborting %d request(s) still in flight", state.num_in_flight)
    for task in list(state.tasks):
        task.cancel()
    await state.wait_idle(5.0)
    return False


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not state.engine.is_ready:
        return web.json_response({"status": "loading"}, status=503)
    return web.json_response({"status": "ready"})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def metrics_handler(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return exc.to_response()
    except web.HTTPException as exc:
        if exc.status == 404:
            return not_found(f"no route {request.method} {request.path}").to_response()
        error = APIError(exc.status, exc.reason, "invalid_request_error")
        return error.to_response()
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return internal_error().to_response()


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[STATE].settings.api_key
    if key and request.path.startswith(_PROTECTED_PREFIXES):
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise unauthorized()
    return await handler(request)


@web.middleware
async def _admission(request: web.Request, handler: Handler) -> web.StreamResponse:
    """503 for generation while loading or draining; count and track requests in flight."""
    if request.method != "POST" or not request.path.startswith("/v1/"):
        return await handler(request)
    state = request.app[STATE]
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
