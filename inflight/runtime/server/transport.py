"""The aiohttp runner with this server's connection-level hardening.

Owns what happens below the app, before routing or authentication:

* an HTTP message aiohttp's own parser rejects (bad request line, bad header, bad
  Content-Length, a line or field over 8190 bytes, more than ``max_header_count`` headers, ...)
  gets a 400 in the OpenAI error shape that names the problem but never echoes the offending
  line back, and the log gets one warning line without it either (a malformed
  ``Authorization`` header would otherwise put the key in the log);
* :class:`ConnectionLimits`: at most ``max_connections`` connections at once (one more is
  answered 503 and closed without a byte of its request read); at most ``max_header_bytes`` of
  one request head are ever handed to the parser (431, then the connection closes); a request
  head must be complete within ``header_timeout_s`` of its first byte (of the connection's
  opening, for its first request), else the connection is closed without an answer;
* ``keepalive_timeout_s`` closes idle connections between requests.

Knows nothing about routes, the engine or the OpenAI schemas.
"""

from __future__ import annotations

import asyncio
import http
import json
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo
from aiohttp.web_request import BaseRequest

from inflight.runtime.server.errors import APIError, unavailable

logger = logging.getLogger("inflight.server.http")
MAX_LINE_BYTES = 8190  # one request line or header field (aiohttp's, gunicorn's and Apache's default)


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Bounds on what an unauthenticated client can make the front end hold.

    ``max_connections``: connections open at once; one more gets a 503 and is closed unread.
    ``max_header_bytes``: the most bytes of one request head (request line and headers) the
    server buffers, vLLM's ``--h11-max-incomplete-event-size`` (431 beyond).
    ``max_header_count``: headers per request, vLLM's ``--h11-max-header-count`` (400 beyond).
    ``header_timeout_s``: the time a client has to send a whole request head, counted from its
    first byte (from the connection's opening for the first request); the connection is closed
    after. Idle keep-alive connections are ``keepalive_timeout_s``'s business.
    """

    max_connections: int = 1024
    max_header_bytes: int = 64 * 1024
    max_header_count: int = 128
    header_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1 (got {self.max_connections}).")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024 (got {self.max_header_bytes}).")
        if self.max_header_count < 1:
            raise ValueError(f"max_header_count must be >= 1 (got {self.max_header_count}).")
        if not self.header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0 seconds (got {self.header_timeout_s}).")

    def parser_args(self) -> dict[str, int]:
        """aiohttp's own per-line, per-field and header-count limits, within the head's."""
        line = min(MAX_LINE_BYTES, self.max_header_bytes)
        return {"max_line_size": line, "max_field_size": line, "max_headers": self.max_header_count}


class HeadTooLarge(HttpProcessingError):
    """A request head that has not ended within ``max_header_bytes``."""

    code = 431

    def __init__(self, limit: int) -> None:
        super().__init__(message=f"request head (request line and headers) larger than {limit} bytes")


class _HardenedRequestHandler(RequestHandler):
    """aiohttp's connection handler, with parse errors answered and logged without echo, and
    the connection cap, the head byte bound and the head deadline of :class:`ConnectionLimits`."""

    def __init__(self, manager: _HardenedServer, *, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._head_bytes = 0  # bytes of the unfinished head handed to the parser
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_refused = False
        self._body: StreamReader | None = None  # the latest request's body, while it arrives

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._manager
        if isinstance(server, _HardenedServer) and server.is_full():
            self._manager = None  # never registered: connection_lost has nothing to undo
            self._force_close = True  # data_received drops whatever arrives
            server.refuse(transport)
            return
        super().connection_made(transport)
        self._start_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Hand the parser at most ``max_header_bytes`` of an unfinished head; body bytes pass."""
        if self._head_refused or self._force_close:
            return
        if not data:
            self._feed(data)  # aiohttp re-parsing what its parser already holds
            return
        while data and self._reading_head():
            room = self._limits.max_header_bytes - self._head_bytes
            if room <= 0:
                self._refuse_head()
                return
            if self._head_timer is None:
                self._start_head_timer()
            part, data = data[:room], data[room:]
            if not self._feed(part):
                self._head_bytes += len(part)
            if self._force_close or self._close:
                return
        if data:
            self._feed(data)

    def _feed(self, data: bytes) -> bool:
        """Parse ``data``; true when a request head ended in it."""
        num_requests = self._request_count
        super().data_received(data)
        if self._request_count == num_requests:
            return False
        self._head_done()
        return True

    def _reading_head(self) -> bool:
        if self._upgraded or self._payload_parser is not None:
            return False
        return self._body is None or self._body.is_eof()

    def _head_done(self) -> None:
        self._head_bytes = 0
        self._stop_head_timer()
        payload = self._messages[-1][1] if self._messages else EMPTY_PAYLOAD
        self._body = None if payload is EMPTY_PAYLOAD else payload

    def _refuse_head(self) -> None:
        """Queue a 431 (after any request in progress) and read nothing more."""
        self._head_refused = True
        self._stop_head_timer()
        exc = HeadTooLarge(self._limits.max_header_bytes)
        self._messages.append((_ErrInfo(status=exc.code, exc=exc, message=exc.message), EMPTY_PAYLOAD))
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _start_head_timer(self) -> None:
        self._head_timer = self._loop.call_later(self._limits.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._request_in_progress:  # a pipelined head behind a request still running
            self._start_head_timer()
            return
        if self.transport is not None:
            logger.debug("closed a connection that sent no whole request head within %g s",
                         self._limits.header_timeout_s)
            self.force_close()

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
        if isinstance(exc, HeadTooLarge):
            error = APIError(431, f"{what}: send smaller headers (the server's --max-header-bytes)",
                             "invalid_request_error", code="request_header_fields_too_large")
        else:
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
    """aiohttp's connection factory, making our handlers and counting the connections they hold."""

    _limits: ConnectionLimits
    _open: set[RequestHandler]
    _full: bool

    def harden(self, limits: ConnectionLimits) -> None:
        self._limits = limits
        self._open = set()
        self._full = False

    def __call__(self) -> RequestHandler:
        return _HardenedRequestHandler(self, loop=self._loop, limits=self._limits, **self._kwargs)

    @property
    def num_connections(self) -> int:
        """Connections open now (refused ones never count)."""
        return len(self._open)

    def is_full(self) -> bool:
        full = len(self._open) >= self._limits.max_connections
        if full != self._full:
            self._full = full
            if full:
                logger.warning("%d connections open (--max-connections): refusing new ones with 503",
                               len(self._open))
            else:
                logger.info("below --max-connections again: accepting connections")
        return full

    def refuse(self, transport: asyncio.BaseTransport) -> None:
        """Answer a connection over the cap 503 without reading it, and close it."""
        error = unavailable(f"the server has {self._limits.max_connections} connections open "
                            "(--max-connections); retry shortly", "too_many_connections")
        if isinstance(transport, asyncio.WriteTransport):
            transport.write(_raw_response(error))
        transport.close()

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self._open.add(handler)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self._open.discard(handler)
        super().connection_lost(handler, exc)


class HardenedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose connections use :class:`_HardenedRequestHandler` under ``limits``."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(app, **kwargs, **limits.parser_args())
        self._limits = limits

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _HardenedServer  # same state, our handler factory
        server.harden(self._limits)
        return server


def make_runner(app: web.Application, keepalive_timeout_s: float,
                limits: ConnectionLimits = ConnectionLimits(), **kwargs: Any) -> web.AppRunner:
    """The runner ``serve`` and the tests use: no access log, cancellation on disconnect."""
    return HardenedAppRunner(
        app, limits, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
        keepalive_timeout=keepalive_timeout_s, **kwargs,
    )


def _raw_response(error: APIError) -> bytes:
    """``error`` as a whole HTTP/1.1 response, for a connection no aiohttp handler serves."""
    body = json.dumps(error.body()).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), "Connection": "close",
               **error.headers}
    head = f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return (head + "\r\n").encode() + body


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:120]
