"""Server-sent events framing for streamed OpenAI responses.

Owns the wire format only: opening a ``text/event-stream`` response, ``data: {json}``
events, the closing ``data: [DONE]`` and an error event for failures after the stream
started (the status line is already sent by then). Knows nothing about the engine.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode("utf-8") + b"\n\n"


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


async def send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(sse_event(payload))


async def close_stream(response: web.StreamResponse) -> None:
    await response.write(DONE)
    await response.write_eof()
