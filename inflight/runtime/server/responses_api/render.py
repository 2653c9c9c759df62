"""Render a chat completion as a Responses API answer: the Response object, or its stream events.

Owns the output side of /v1/responses: output items (``reasoning`` when the model's reasoning
is split out, ``message`` with ``output_text``, ``function_call``), ``status`` /
``incomplete_details`` (``max_output_tokens`` for a cut answer), usage, and the stream events
with their names and ``sequence_number`` (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta`` and the matching
``.done`` events, ``response.output_item.done``, ``response.completed`` or
``response.incomplete``). ``on_done`` receives each finished Response (the store). Knows
nothing about HTTP or the engine: the generation loop hands it chat bodies and chat choices.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from inflight.runtime.server.errors import APIError

OnDone = Callable[[dict[str, Any]], None]


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage(chat_usage: dict[str, int]) -> dict[str, Any]:
    """The Responses usage for a chat ``usage``."""
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["prompt_tokens"] + chat_usage["completion_tokens"]}


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": content}


def reasoning_item(text: str, item_id: str | None = None, done: bool = True) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if done else []
    return {"type": "reasoning", "id": item_id or _id("rs"), "summary": [], "content": content,
            "status": "completed" if done else "in_progress"}


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
              done: bool = True) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or _id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": "completed" if done else "in_progress"}


class ResponsesRenderer:
    """One /v1/responses request's rendering (``echo``: the request fields the Response repeats)."""

    endpoint = "responses"

    def __init__(self, echo: dict[str, Any], model: str, on_done: OnDone | None = None) -> None:
        self.echo = echo
        self.model = model
        self.on_done = on_done
        self.response_id = _id("resp")

    def response(self, created: int, status: str, output: list[dict[str, Any]],
                 usage_counts: dict[str, Any] | None, finish_reason: str | None = None) -> dict[str, Any]:
        """The Response object; ``finish_reason`` "length" makes a completed one ``incomplete``."""
        if status == "completed" and finish_reason == "length":
            status = "incomplete"
        return {
            "id": self.response_id, "object": "response", "created_at": created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model, "output": output, "usage": usage_counts, **self.echo,
            "store": self.on_done is not None,
        }

    def finished(self, response: dict[str, Any]) -> dict[str, Any]:
        if self.on_done is not None:
            self.on_done(response)
        return response

    def body(self, chat_body: dict[str, Any], choices: Sequence[Any] = ()) -> dict[str, Any]:
        choice = chat_body["choices"][0]
        message = choice["message"]
        output = []
        if message.get("reasoning_content"):
            output.append(reasoning_item(message["reasoning_content"]))
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            output.append(message_item(message.get("content") or ""))
        output += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return self.finished(self.response(chat_body["created"], "completed", output, usage(chat_body["usage"]),
                                           choice["finish_reason"]))

    def stream(self, meta: dict[str, Any], num_prompt_tokens: int) -> ResponsesStream:
        return ResponsesStream(self, meta["created"])


class ResponsesStream:
    """The events of one streamed response: output items opened as the chat deltas call for them
    (reasoning text, message text, each tool call) and closed, with their ``.done`` events, when
    the next begins or the stream ends."""

    def __init__(self, renderer: ResponsesRenderer, created: int) -> None:
        self.renderer = renderer
        self.created = created
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed, its text in "_text"
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()

    def opening(self) -> bytes:
        response = self.renderer.response(self.created, "in_progress", [], None)
        return self.event("response.created", response=response) + self.event("response.in_progress", response=response)

    def choice(self, choice: dict[str, Any]) -> bytes:
        delta = choice["delta"]
        out = []
        if delta.get("reasoning_content"):
            out += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            out += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            out += self._call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _text(self, kind: str, text: str) -> list[bytes]:
        out = [] if self.open is not None and self.open["type"] == kind else self._open(kind)
        assert self.open is not None
        self.open["_text"].append(text)
        if kind == "message":
            out.append(self.event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                  logprobs=[]))
        else:
            out.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        return out

    def _open(self, kind: str) -> list[bytes]:
        """Close the open item and open a message or reasoning item with its one content part."""
        out = self._close()
        if kind == "message":
            item, part = message_item("", "in_progress"), {"type": "output_text", "text": "", "annotations": []}
        else:
            item, part = reasoning_item("", done=False), {"type": "reasoning_text", "text": ""}
        self.open = {**item, "_text": []}
        out.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        out = []
        fn = call.get("function") or {}
        args = fn.get("arguments") or ""
        if call.get("id") is not None:  # a new call (a continuation carries arguments only)
            out += self._close()
            item = call_item(call["id"], fn["name"], "", done=False)
            self.open = {**item, "_text": []}
            out.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        if args and self.open is not None and self.open["type"] == "function_call":
            self.open["_text"].append(args)
            out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=args))
        return out

    def _close(self) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        text = "".join(item["_text"])
        out = []
        if item["type"] == "message":
            done = message_item(text, item_id=item["id"])
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=done["content"][0]))
        elif item["type"] == "reasoning":
            done = reasoning_item(text, item_id=item["id"])
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=done["content"][0]))
        else:
            done = call_item(item["call_id"], item["name"], text, item_id=item["id"])
            out.append(self.event("response.function_call_arguments.done", **where, arguments=text,
                                  name=item["name"]))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=done))
        self.output.append(done)
        self.open = None
        return out

    def closing(self, chat_usage: dict[str, int], choices: Sequence[Any] = ()) -> bytes:
        out = self._close()
        if not self.output:  # nothing was said: an empty message, as the non-streamed answer has
            out += self._open("message") + self._close()
        response = self.renderer.finished(self.renderer.response(
            self.created, "completed", self.output, usage(chat_usage), self.finish_reason))
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return b"".join(out) + self.event(kind, response=response)

    def failure(self, error: APIError) -> bytes:
        body = error.body()["error"]
        assert isinstance(body, dict)
        return self.event("error", code=body.get("code") or body.get("type"), message=body["message"],
                          param=body.get("param"))
