"""The aiohttp runner with this server's connection-level hardening.

Owns what happens below the app: an HTTP message aiohttp's own parser rejects (bad request
line, bad header, bad Content-Length, ...) gets a 400 in the OpenAI error shape that names
the problem but never echoes the offending line back, and the log gets one warning line
without it either (a malformed ``Authorization`` header would otherwise put the key in the
log). ``keepalive_timeout_s`` closes idle connections and connections that never finish
sending a request head. Knows nothing about routes, the engine or the OpenAI schemas.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest

from inflight.runtime.server.errors import APIError

logger = logging.getLogger("inflight.server.http")


class _HardenedRequestHandler(RequestHandler):
    """aiohttp's connection handler, with parse errors answered and logged without echo."""

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        what = _first_line(message or exc.message or "malformed request").rstrip(":")
        logger.warning("malformed HTTP request from %s: %s (%s)", request.remote, what, type(exc).__name__)
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send the error")
        error = APIError(status if 400 <= status < 500 else 400, f"malformed HTTP request: {what}",
                         "invalid_request_error", code="bad_http_request")
        response = error.to_response()
        response.force_close()
        return response


    def log_exception(self, *args: Any, **kw: Any) -> None:
        """An undecodable body (bad gzip, ...) was already answered with a 400: one line, no trace."""
        exc = kw.get("exc_info")
        if isinstance(exc, (RequestPayloadError, HttpProcessingError)):
            logger.warning("dropped the rest of an undecodable request body (%s)", type(exc).__name__)
            return
        super().log_exception(*args, **kw)


class _HardenedServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _HardenedRequestHandler(self, loop=self._loop, **self._kwargs)


class HardenedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections use :class:`_HardenedRequestHandler`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _HardenedServer  # same state, our handler factory
        return server


def make_runner(app: web.Application, keepalive_timeout_s: float, **kwargs: Any) -> web.AppRunner:
    """The runner ``serve`` and the tests use: no access log, cancellation on disconnect."""
    return HardenedAppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
        keepalive_timeout=keepalive_timeout_s, **kwargs,
    )


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:120]
