"""The assistant message of a chat choice: content, ``reasoning_content`` and ``tool_calls``.

``ChatOutputPlan`` says, per request, whether to split reasoning and which tool-call format to
parse (a model family for ``tool_choice: auto``, ``required`` / ``named`` for forced calls).
:func:`build_message` turns a finished choice's text into the non-streamed message;
:class:`ChatStream` turns text deltas into OpenAI delta objects whose concatenation gives the
same message (tool calls are sent whole as soon as each is complete, found incrementally by
``tool_stream.ToolStream``; a named call streams its arguments as they come). A harmony (gpt-oss)
output is read by its channels instead (``tool_parsers.harmony``: analysis -> reasoning, final ->
content, ``to=functions.x`` -> calls), unless a forced call's grammar made it plain JSON.
Knows nothing about HTTP or the engine.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from inflight.runtime.json_text import loads_limited
from inflight.runtime.server.openai.reasoning import ReasoningStream, split_reasoning
from inflight.runtime.server.openai.tool_calls import ToolCall, parse_tool_calls
from inflight.runtime.server.openai.tool_parsers.harmony import HarmonyStream, parse_harmony
from inflight.runtime.server.openai.tool_stream import ToolStream


@dataclass(frozen=True, slots=True)
class ChatOutputPlan:
    reasoning: bool = False  # split <think>...</think> into reasoning_content
    starts_in_reasoning: bool = False  # the prompt already opened <think>
    tool_mode: str | None = None  # None, a family (hermes/llama3/mistral), "required" or "named"
    tool_name: str | None = None  # the forced function for "named"
    single_call: bool = False  # parallel_tool_calls false: only the first call is returned
    tools: tuple[dict[str, Any], ...] = ()  # the request's tools (their schemas type some formats' values)
    harmony: bool = False  # the template speaks harmony: read the output by its channels

    @property
    def is_plain(self) -> bool:
        return not self.reasoning and self.tool_mode is None and not self.harmony

    @property
    def by_channels(self) -> bool:
        """Read by harmony's channels: a harmony template, unless a grammar forced a call."""
        return self.harmony and self.tool_mode in (None, "harmony")


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _call_json(call: ToolCall, call_id: str) -> dict[str, Any]:
    return {"id": call.call_id or call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def build_message(plan: ChatOutputPlan, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """(message, finish_reason): ``tool_calls`` replaces ``stop`` when the model called tools."""
    if plan.by_channels:
        return _harmony_message(plan, text, finish_reason)
    reasoning, content = split_reasoning(text, plan.starts_in_reasoning) if plan.reasoning else (None, text)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if plan.tool_mode is not None:
        parsed = parse_tool_calls(plan.tool_mode, content, plan.tool_name, plan.tools)
        message["content"] = parsed.content
        calls = parsed.tool_calls[:1] if plan.single_call else parsed.tool_calls
        if calls:
            message["tool_calls"] = [_call_json(c, new_call_id()) for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
    return message, finish_reason


def _harmony_message(plan: ChatOutputPlan, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    out = parse_harmony(text, with_tools=plan.tool_mode == "harmony")
    calls = out.tool_calls[:1] if plan.single_call else out.tool_calls
    content: str | None = out.content
    if plan.tool_mode is not None and not content.strip():
        content = None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if out.reasoning is not None:
        message["reasoning_content"] = out.reasoning
    if calls:
        message["tool_calls"] = [_call_json(c, new_call_id()) for c in calls]
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    return message, finish_reason


class ChatStream:
    """One streamed choice: feed text deltas, get OpenAI ``delta`` objects."""

    def __init__(self, plan: ChatOutputPlan) -> None:
        self.plan = plan
        self.harmony = HarmonyStream(plan.tool_mode == "harmony") if plan.by_channels else None
        self.reasoning = ReasoningStream(plan.starts_in_reasoning) if plan.reasoning and not self.harmony else None
        use_tools = plan.tool_mode and not self.harmony
        self.tools = ToolStream(plan.tool_mode, plan.tool_name, plan.tools) if use_tools else None
        self.num_calls = 0
        self.named_id: str | None = None

    def feed(self, text: str, finished: bool) -> dict[str, Any]:
        if self.harmony is not None:
            return self._feed_harmony(text, finished)
        delta: dict[str, Any] = {}
        content = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(text, finished)
            if reasoning:
                delta["reasoning_content"] = reasoning
        if self.tools is None:
            if content:
                delta["content"] = content
            return delta
        content, calls, args = self.tools.feed(content, finished)
        if content:
            delta["content"] = content
        if self.plan.single_call:
            calls = calls[: max(0, 1 - self.num_calls)]
        items = [self._call_delta(c) for c in calls]
        if self.plan.tool_mode == "named" and (args or self.named_id is None):
            items.append(self._named_delta(args))
        if items:
            delta["tool_calls"] = items
        return delta

    def _feed_harmony(self, text: str, finished: bool) -> dict[str, Any]:
        assert self.harmony is not None
        reasoning, content, calls = self.harmony.feed(text, finished)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if self.plan.single_call:
            calls = calls[: max(0, 1 - self.num_calls)]
        if calls:
            delta["tool_calls"] = [self._call_delta(c) for c in calls]
        return delta

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self._called() else reason

    def _called(self) -> bool:
        if self.plan.tool_mode == "named":
            return self.tools is not None and _is_json_object(self.tools.text)
        return self.num_calls > 0

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        item = {"index": self.num_calls, **_call_json(call, new_call_id())}
        self.num_calls += 1
        return item

    def _named_delta(self, args: str) -> dict[str, Any]:
        if self.named_id is None:
            self.named_id = new_call_id()
            return {"index": 0, "id": self.named_id, "type": "function",
                    "function": {"name": self.plan.tool_name, "arguments": args}}
        return {"index": 0, "function": {"arguments": args}}


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(loads_limited(text), dict)
    except ValueError:
        return False
