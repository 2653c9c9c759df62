"""Connection-level limits that hold before authentication (issue 46, finding 8): a request head
over ``--max-header-bytes`` gets a 431 and the parser never holds more of it, a connection over
``--max-connections`` is refused unread while the first ones stay open (and /health answers
again once they close), and a head that has not ended within ``--header-timeout`` loses its
connection while an idle keep-alive connection keeps its own, longer, timeout.

Raw sockets against a live server with a tiny model; every wait is bounded by a generous
pytest-level limit, never a guess at how fast the server is."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.transport import ConnectionLimits
from tests.server.server_helpers import MODEL_NAME, LiveServer, http, wait_until

MAX_HEADER_BYTES = 16 * 1024
MAX_CONNECTIONS = 4
HEADER_TIMEOUT_S = 1.0
KEEPALIVE_S = 300.0  # far beyond every wait here: only the limits under test may close a connection
WAIT_S = 30.0  # the most any test waits for the server to act
# ~1 MB: one header short of aiohttp's own count limit, so only the byte cap can stop it
MEGABYTE_HEADERS = 127
HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"
ENGINE = EngineConfig(max_num_sequences=2, num_kv_blocks=32, max_model_len=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("limits-model") / "demo", size="tiny")


def _serve(model_dir: Path, header_timeout_s: float) -> LiveServer:
    limits = ConnectionLimits(max_connections=MAX_CONNECTIONS, max_header_bytes=MAX_HEADER_BYTES,
                              header_timeout_s=header_timeout_s)
    settings = ServerSettings(model_name=MODEL_NAME, keepalive_timeout_s=KEEPALIVE_S, connection_limits=limits)
    return LiveServer(model_dir, ENGINE, settings).start()


@pytest.fixture(scope="module")
def limited(model_dir: Path) -> Iterator[LiveServer]:
    """Small head and connection caps; a head deadline no test comes near."""
    live = _serve(model_dir, header_timeout_s=WAIT_S * 10)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def hasty(model_dir: Path) -> Iterator[LiveServer]:
    """A one-second head deadline."""
    live = _serve(model_dir, header_timeout_s=HEADER_TIMEOUT_S)
    yield live
    live.stop()


def _on_loop(live: LiveServer, fn: Any) -> Any:
    """``fn()`` run on the server's event loop thread."""
    async def call() -> Any:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), live.loop).result(WAIT_S)


def _num_connections(live: LiveServer) -> int:
    return _on_loop(live, lambda: len(live.runner.server.connections))  # type: ignore[union-attr]


class _CountingParser:
    """The connection's parser, counting the bytes it is handed."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.num_bytes = 0

    def feed_data(self, data: bytes) -> Any:
        self.num_bytes += len(data)
        return self.parser.feed_data(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parser, name)


def _spy_on_only_connection(live: LiveServer) -> _CountingParser:
    def install() -> _CountingParser:
        (handler,) = live.runner.server.connections  # type: ignore[union-attr]
        spy = _CountingParser(handler._parser)
        handler._parser = spy
        return spy

    return _on_loop(live, install)


def _read_reply(sock: socket.socket) -> bytes:
    """Bytes until the server closes the connection (or resets it)."""
    sock.settimeout(WAIT_S)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else 0


def _body(raw: bytes) -> dict[str, Any]:
    return json.loads(raw.partition(b"\r\n\r\n")[2])


def _keepalive_request(sock: socket.socket) -> bytes:
    """One whole GET /health on an open connection; the connection stays open."""
    sock.sendall(HEAD + b"\r\n")
    sock.settimeout(WAIT_S)
    raw = b""
    while True:
        head, sep, body = raw.partition(b"\r\n\r\n")
        match = re.search(rb"content-length: *(\d+)", head, re.I)
        if sep and match and len(body) >= int(match.group(1)):
            return raw
        chunk = sock.recv(65536)
        assert chunk, f"the server closed a keep-alive connection: {raw!r}"
        raw += chunk


def _headers(num_headers: int) -> bytes:
    """Headers of 8000 bytes each (within aiohttp's own 8190-byte field limit)."""
    line = b"X-Pad-%03d: " + b"a" * 7986 + b"\r\n"
    return b"".join(line % i for i in range(num_headers))


def test_a_head_over_the_byte_cap_is_431_and_the_parser_never_holds_more(limited: LiveServer) -> None:
    assert wait_until(lambda: _num_connections(limited) == 0, WAIT_S)
    with socket.create_connection(("127.0.0.1", limited.port), timeout=WAIT_S) as sock:
        assert wait_until(lambda: _num_connections(limited) == 1, WAIT_S)
        spy = _spy_on_only_connection(limited)
        sock.sendall(HEAD + _headers(3))  # 24 KB, never ending the head
        raw = _read_reply(sock)
    assert _status(raw) == 431, raw[:200]
    assert _body(raw)["error"]["code"] == "request_header_fields_too_large"
    assert spy.num_bytes <= MAX_HEADER_BYTES


def test_a_megabyte_of_headers_is_refused_after_at_most_the_cap(limited: LiveServer) -> None:
    assert wait_until(lambda: _num_connections(limited) == 0, WAIT_S)
    with socket.create_connection(("127.0.0.1", limited.port), timeout=WAIT_S) as sock:
        assert wait_until(lambda: _num_connections(limited) == 1, WAIT_S)
        spy = _spy_on_only_connection(limited)
        try:
            sock.sendall(HEAD + _headers(MEGABYTE_HEADERS))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused and closed while we were still sending
        raw = _read_reply(sock)
    assert _status(raw) in (431, 0), raw[:200]  # 0: closed (a reset may overtake the 431)
    assert spy.num_bytes <= MAX_HEADER_BYTES
    assert http("GET", f"{limited.url}/health").status == 200


def test_connections_over_the_cap_are_refused_until_the_first_close(limited: LiveServer) -> None:
    assert wait_until(lambda: _num_connections(limited) == 0, WAIT_S)
    held = [socket.create_connection(("127.0.0.1", limited.port), timeout=WAIT_S) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # each held open, idle between requests
            assert _status(_keepalive_request(sock)) == 200
        assert _num_connections(limited) == MAX_CONNECTIONS
        with socket.create_connection(("127.0.0.1", limited.port), timeout=WAIT_S) as extra:
            try:
                extra.sendall(HEAD + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            raw = _read_reply(extra)
        assert _status(raw) in (503, 0), raw[:200]  # 0: closed (a reset may overtake the 503)
        if raw:
            assert _body(raw)["error"]["code"] == "too_many_connections"
        assert _num_connections(limited) == MAX_CONNECTIONS
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: http("GET", f"{limited.url}/health", timeout=WAIT_S).status == 200, WAIT_S)


def test_a_dribbled_head_loses_its_connection_but_idle_keepalive_does_not(hasty: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", hasty.port), timeout=WAIT_S) as sock:
        assert _status(_keepalive_request(sock)) == 200
        time.sleep(2 * HEADER_TIMEOUT_S)  # idle between requests: keep-alive's business, not the head deadline's
        assert _status(_keepalive_request(sock)) == 200
        sock.sendall(HEAD + b"X-Slow: ")
        sock.settimeout(0.05)
        deadline = time.monotonic() + WAIT_S
        raw = None
        while raw is None and time.monotonic() < deadline:
            try:
                sock.sendall(b"a")  # one byte at a time, never the end of the head
                raw = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                raw = b""
    assert raw == b"", f"the server kept a dribbling head open for {WAIT_S} s" if raw is None else raw[:200]


def test_a_connection_that_sends_nothing_is_closed_after_the_head_deadline(hasty: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", hasty.port), timeout=WAIT_S) as sock:
        try:
            raw = _read_reply(sock)
        except TimeoutError:
            raw = None
    assert raw == b""


def test_a_body_far_over_the_head_cap_and_a_request_behind_it_are_served(limited: LiveServer) -> None:
    """Only heads count against the cap: a 40 KB body, and a pipelined request after it in the
    same packet, are parsed as such (a guard for the byte accounting, true before it too)."""
    assert wait_until(lambda: _num_connections(limited) == 0, WAIT_S)
    body = json.dumps({"model": MODEL_NAME, "prompt": "x " * 20_000, "max_tokens": 1}).encode()
    first = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", limited.port), timeout=WAIT_S) as sock:
        sock.sendall(first + HEAD + b"Connection: close\r\n\r\n")
        raw = _read_reply(sock)
    assert [int(s) for s in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)] == [400, 200], raw[:300]
