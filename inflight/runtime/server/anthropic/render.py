"""Render a chat completion as an Anthropic Messages answer: the message, or its stream events.

Owns the output side of /v1/messages: content blocks (``thinking`` when the model's reasoning is
split out, ``text``, ``tool_use`` with its ``input`` object), ``stop_reason`` (``end_turn``,
``max_tokens``, ``stop_sequence`` with the ``stop_sequence`` that ended it, ``tool_use``), usage
(``input_tokens`` / ``output_tokens``), the stream events (``message_start``, ``ping``,
``content_block_start``, ``content_block_delta`` with ``text_delta`` / ``input_json_delta`` /
``thinking_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``) and Anthropic's
error shape. Knows nothing about HTTP or the engine: the generation loop hands it chat bodies and
chat choices.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

from inflight.runtime.server.errors import APIError

# Anthropic's error types by HTTP status (anything else: invalid_request_error below 500,
# api_error from 500).
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


class MessagesRenderer:
    """One /v1/messages request's rendering (which of ``stop_sequences`` ended the answer is the
    choice's ``stop_reason``, the stop string the text path cut it at)."""

    endpoint = "messages"

    def __init__(self, model: str, stop_sequences: Sequence[str]) -> None:
        self.model = model
        self.stop_sequences = tuple(stop_sequences)
        self.message_id = f"msg_{secrets.token_hex(12)}"

    def stop(self, finish_reason: str | None, choices: Sequence[Any]) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) for a chat finish reason."""
        if finish_reason == "tool_calls":
            return "tool_use", None
        if finish_reason == "length":
            return "max_tokens", None
        if finish_reason == "stop" and choices and choices[0].stop_reason in self.stop_sequences:
            return "stop_sequence", choices[0].stop_reason
        return "end_turn", None

    def body(self, chat_body: dict[str, Any], choices: Sequence[Any] = ()) -> dict[str, Any]:
        choice = chat_body["choices"][0]
        message = choice["message"]
        content: list[dict[str, Any]] = []
        if message.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            content.append(_tool_use(call["id"], call["function"]["name"], call["function"]["arguments"]))
        reason, sequence = self.stop(choice["finish_reason"], choices)
        usage = chat_body["usage"]
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": _usage(usage["prompt_tokens"], usage["completion_tokens"])}

    def stream(self, meta: dict[str, Any], num_prompt_tokens: int) -> MessagesStream:
        return MessagesStream(self, num_prompt_tokens)


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        arguments_object = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        arguments_object = None
    if not isinstance(arguments_object, dict):  # never seen from the parsers; say so rather than drop it
        arguments_object = {"_unparsed_arguments": arguments}
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments_object}


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, separators=(',', ':'))}\n\n".encode()


class MessagesStream:
    """The events of one streamed message: a content block opened as the chat deltas call for it
    (thinking, text, each tool call) and stopped when the next begins or the stream ends."""

    def __init__(self, renderer: MessagesRenderer, num_prompt_tokens: int) -> None:
        self.renderer = renderer
        self.num_prompt_tokens = num_prompt_tokens
        self.index = -1  # the open block's index
        self.open: str | None = None  # its kind: thinking, text, tool_use
        self.finish_reason: str | None = None

    def opening(self) -> bytes:
        message = {"id": self.renderer.message_id, "type": "message", "role": "assistant",
                   "model": self.renderer.model, "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": _usage(self.num_prompt_tokens, 0)}
        return _event("message_start", {"message": message}) + _event("ping", {})

    def choice(self, choice: dict[str, Any]) -> bytes:
        delta = choice["delta"]
        out = []
        if delta.get("reasoning_content"):
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
        if delta.get("content"):
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id") is not None:
                out += self._open("tool_use", {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": {}},
                                  new=True)
            if fn.get("arguments") and self.open == "tool_use":
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _open(self, kind: str, block: dict[str, Any], new: bool = False) -> list[bytes]:
        if self.open == kind and not new:
            return []
        out = self._close()
        self.index += 1
        self.open = kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def closing(self, usage: dict[str, int], choices: Sequence[Any] = ()) -> bytes:
        reason, sequence = self.renderer.stop(self.finish_reason, choices)
        return b"".join([
            *self._close(),
            _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": {"output_tokens": usage["completion_tokens"]}}),
            _event("message_stop", {}),
        ])

    def failure(self, error: APIError) -> bytes:
        return _event("error", {"error": error_body(error.status, error.message)["error"]})
