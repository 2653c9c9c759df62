"""Server-sent events for streamed OpenAI responses: framing and a cheap, bounded send.

Owns the wire side only: opening a ``text/event-stream`` response, ``data: {json}`` events
(:class:`ChunkFormat` renders a stream's constant head once and only each choice's JSON per
event), the closing ``data: [DONE]``, an error event for failures after the stream started
(the status line is already sent by then), and :class:`SseSender`, which writes without a
timer while the client keeps reading and waits (bounded) only while the connection's writing
is paused. Also the seam other APIs plug into (:class:`Renderer`, :class:`StreamFormat`): the
generation loop hands them the chat body, or each streamed chat choice, and writes the bytes
they return; :class:`OpenAIStream` is the OpenAI chat / completion format. Knows nothing about
the engine.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aiohttp import web

from inflight.runtime.server.errors import APIError
from inflight.runtime.server.openai.responses import ChoiceState, chat_delta, usage_chunk

DONE = b"data: [DONE]\n\n"
_COMPACT = json.JSONEncoder(separators=(",", ":"))  # one encoder: json.dumps(separators=...) builds one per call


def _compact_encoder() -> Callable[[Any], str]:
    """``_COMPACT.encode``, minus the C encoder it builds on every call (half its cost for a
    streamed choice: 1.7 against 3.3 us here, once per streamed token). The same C function and
    arguments ``JSONEncoder.iterencode`` passes, but no circular-reference check (a choice is
    plain data); ``_COMPACT.encode`` where the C accelerator is missing."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return _COMPACT.encode
    iterencode = make(None, _COMPACT.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)
    return lambda value: "".join(iterencode(value, 0))


_encode = _compact_encoder()
_CHUNK_FRAMING_BYTES = 32  # aiohttp's chunked transfer encoding: hex length and two CRLFs


def sse_event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    return b"data: " + _encode(payload).encode("utf-8") + b"\n\n"


class ChunkFormat:
    """The events of one stream: ``{**meta, "object": obj, "choices": [choice]}`` (plus
    ``"usage": null`` with ``include_usage``), byte for byte what :func:`sse_event` makes of
    that dict, with the constant head (id, created, model, object) rendered once."""

    def __init__(self, meta: dict[str, Any], obj: str, include_usage: bool) -> None:
        head = _encode({**meta, "object": obj, "choices": None})
        self._head = b"data: " + head[: -len("null}")].encode("utf-8") + b"["
        self._tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"

    def event(self, choice: dict[str, Any]) -> bytes:
        """One chunk carrying ``choice`` (index, delta or text, logprobs, finish_reason)."""
        return self._head + _encode(choice).encode("utf-8") + self._tail


class StreamFormat(Protocol):
    """How one stream is written: the generation loop calls :meth:`opening` once, :meth:`choice`
    for each streamed chat choice (``{index, delta, logprobs, finish_reason}``, the choice of an
    OpenAI chat chunk), then :meth:`closing` with the usage, or :meth:`failure` for an error after
    the status line went out. Each returns the bytes to write, terminator included."""

    def opening(self) -> bytes: ...

    def choice(self, choice: dict[str, Any]) -> bytes: ...

    def closing(self, usage: dict[str, int], choices: Sequence[ChoiceState]) -> bytes: ...

    def failure(self, error: APIError) -> bytes: ...


class Renderer(Protocol):
    """Another API served by the chat pipeline: the finished chat completion body in, its own
    body out (:meth:`body`; ``choices``: what each choice produced), and its own stream events (:meth:`stream`, given the stream's
    ``meta``: id, created, model; and the prompt's token count). ``endpoint`` names it in the
    request log line."""

    endpoint: str

    def body(self, chat_body: dict[str, Any], choices: Sequence[ChoiceState]) -> dict[str, Any]: ...

    def stream(self, meta: dict[str, Any], num_prompt_tokens: int) -> StreamFormat: ...


class OpenAIStream:
    """The OpenAI chat / completion stream: ``opening`` (a chat stream's role chunks), one chunk
    per choice, the usage chunk with ``include_usage``, ``data: [DONE]``."""

    def __init__(self, meta: dict[str, Any], obj: str, include_usage: bool) -> None:
        self._meta = meta
        self._obj = obj
        self._include_usage = include_usage
        self._chunks = ChunkFormat(meta, obj, include_usage)
        self.head = b""  # the opening events

    def opening(self) -> bytes:
        return self.head

    def choice(self, choice: dict[str, Any]) -> bytes:
        return self._chunks.event(choice)

    def closing(self, usage: dict[str, int], choices: Sequence[ChoiceState]) -> bytes:
        if not self._include_usage:
            return DONE
        return sse_event(usage_chunk(self._meta, self._obj, usage)) + DONE

    def failure(self, error: APIError) -> bytes:
        return sse_event(error.body()) + DONE


def openai_format(meta: dict[str, Any], is_chat: bool, include_usage: bool, indices: list[int],
                  echo_text: str) -> OpenAIStream:
    """The OpenAI stream of a completion, or of a chat, which opens with each choice's role,
    then (vLLM) an echoed final message (``echo_text``)."""
    if not is_chat:
        return OpenAIStream(meta, "text_completion", include_usage)
    fmt = OpenAIStream(meta, "chat.completion.chunk", include_usage)
    events = [fmt.choice(chat_delta(i, {"role": "assistant", "content": ""}, None)) for i in indices]
    if echo_text:
        events += [fmt.choice(chat_delta(i, {"content": echo_text}, None)) for i in indices]
    fmt.head = b"".join(events)
    return fmt


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

    async def close(self, last: bytes = DONE) -> None:
        """Write ``last`` (the stream's closing events: ``data: [DONE]`` for OpenAI's), then end
        the response."""
        await self.write(last)
        await asyncio.wait_for(self._response.write_eof(), self._timeout_s)


async def send_error(response: web.StreamResponse, event: bytes, timeout_s: float) -> None:
    """An error ``event`` (its terminator included) and the end of the stream, within
    ``timeout_s``; a client that left or stopped reading is let go."""
    async def send() -> None:
        await response.write(event)
        await response.write_eof()

    try:
        await asyncio.wait_for(send(), timeout_s)
    except (OSError, asyncio.TimeoutError):
        pass
