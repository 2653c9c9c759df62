"""Server-sent events for streamed OpenAI responses: framing and a cheap, bounded send.

Owns the wire side only: opening a ``text/event-stream`` response, ``data: {json}`` events
(:class:`ChunkFormat` renders a stream's constant head once and only each choice's JSON per
event), the closing ``data: [DONE]``, an error event for failures after the stream started
(the status line is already sent by then), and :class:`SseSender`, which writes without a
timer while the client keeps reading and waits (bounded) only while the connection's writing
is paused. Knows nothing about the engine.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"
_COMPACT = json.JSONEncoder(separators=(",", ":"))  # one encoder: json.dumps(separators=...) builds one per call
_CHUNK_FRAMING_BYTES = 32  # aiohttp's chunked transfer encoding: hex length and two CRLFs


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    return b"data: " + _COMPACT.encode(payload).encode("utf-8") + b"\n\n"


class ChunkFormat:
    """The events of one stream: ``{**meta, "object": obj, "choices": [choice]}`` (plus
    ``"usage": null`` with ``include_usage``), byte for byte what :func:`sse_event` makes of
    that dict, with the constant head (id, created, model, object) rendered once."""

    def __init__(self, meta: dict[str, Any], obj: str, include_usage: bool) -> None:
        head = _COMPACT.encode({**meta, "object": obj, "choices": None})
        self._head = b"data: " + head[: -len("null}")].encode("utf-8") + b"["
        self._tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"

    def event(self, choice: dict[str, Any]) -> bytes:
        """One chunk carrying ``choice`` (index, delta or text, logprobs, finish_reason)."""
        return self._head + _COMPACT.encode(choice).encode("utf-8") + self._tail


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Send the headers of an SSE response and return it for ``write``."""
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )
    await response.prepare(request)
    return response


class SseSender:
    """Writes a stream's bytes. While the client reads, a write goes straight to the transport
    (no timer, no task); when the connection's writing is paused (the transport's buffer is
    over its high-water mark: the client stopped reading), or this write would pause it, the
    write waits for the drain under ``timeout_s`` and raises ``asyncio.TimeoutError`` past it
    (``asyncio.wait_for``: Python 3.10 has no ``asyncio.timeout``)."""

    def __init__(self, request: web.Request, response: web.StreamResponse, timeout_s: float) -> None:
        self._response = response
        self._protocol = request.protocol
        self._timeout_s = timeout_s
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("the client went away before the stream started")
        self._high_water = transport.get_write_buffer_limits()[1]

    async def write(self, data: bytes) -> None:
        protocol = self._protocol
        transport = protocol.transport
        if transport is None:
            raise ConnectionResetError("the client went away")
        if (not protocol.writing_paused
                and transport.get_write_buffer_size() + len(data) + _CHUNK_FRAMING_BYTES <= self._high_water):
            await self._response.write(data)  # cannot pause the transport, so it never waits
            return
        await asyncio.wait_for(self._write_when_resumed(data), self._timeout_s)

    async def _write_when_resumed(self, data: bytes) -> None:
        if self._protocol.writing_paused:
            await self._protocol._drain_helper()  # aiohttp's (and asyncio's) wait for resume_writing
        await self._response.write(data)

    async def close(self, last: bytes = b"") -> None:
        """Write ``last`` and ``data: [DONE]``, then end the response."""
        await self.write(last + DONE)
        await asyncio.wait_for(self._response.write_eof(), self._timeout_s)


async def send_error(response: web.StreamResponse, payload: dict[str, Any], timeout_s: float) -> None:
    """An error event and the end of the stream, within ``timeout_s``; a client that left or
    stopped reading is let go."""
    async def send() -> None:
        await response.write(sse_event(payload) + DONE)
        await response.write_eof()

    try:
        await asyncio.wait_for(send(), timeout_s)
    except (OSError, asyncio.TimeoutError):
        pass
