"""gpt-oss's harmony channels (vLLM's ``openai`` tool parser and ``openai_gptoss`` reasoning
parser), whole or streamed. After the prompt's ``<|start|>assistant`` the model writes messages::

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>

* ``analysis`` -> ``reasoning_content``; ``final`` and ``commentary`` (a preamble) -> content;
* a message to ``functions.NAME`` (``to=`` in the header, before or after the channel) -> a tool
  call whose arguments are its body, a JSON object (when the request offers tools; otherwise
  its body is content);
* ``<|call|>`` and ``<|return|>`` are the model's stop tokens, so the last message usually ends
  with the text; text outside any message is content.

Bounded like the other parsers: a header is at most ``MAX_HEADER`` characters (past that, the
rest of the output is content), every position is searched once, a call's body that is no JSON
object stays content (header and all). Knows nothing about HTTP, the engine or tokenizers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from inflight.runtime.server.openai.tool_parsers.common import (
    ToolCall,
    find_first,
    json_object,
    partial_any_len,
    render_arguments,
)

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
OPENERS = (START, CHANNEL)
MAX_HEADER = 1024
FUNCTIONS = "functions."
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([^\s<]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass(frozen=True, slots=True)
class HarmonyOutput:
    reasoning: str | None  # None when the output has no analysis message
    content: str
    tool_calls: tuple[ToolCall, ...]


def is_harmony(chat_template: str | None) -> bool:
    """Whether a chat template speaks harmony (gpt-oss's)."""
    return CHANNEL in (chat_template or "") and MESSAGE in (chat_template or "")


class HarmonyStream:
    """Feed text deltas; get (reasoning delta, content delta, completed calls)."""

    def __init__(self, with_tools: bool) -> None:
        self.with_tools = with_tools
        self.text = ""
        self.state = "top"  # top -> header -> body -> top ...; plain: the rest is content
        self.sent = self.cursor = self.header_start = 0
        self.dest = "content"  # reasoning, content or call
        self.call_name = ""
        self.saw_reasoning = False
        self.scanned = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, str, list[ToolCall]]:
        text, self.text = self.text, ""
        text += delta
        self.text = text
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        calls: list[ToolCall] = []
        while True:
            before = (self.state, self.sent, self.cursor)
            if self.state == "top":
                self._top(out, finished)
            elif self.state == "header":
                self._header(out, finished)
            elif self.state == "body":
                self._body(out, calls, finished)
            else:
                out["content"].append(self.text[self.sent:])
                self.sent = self.cursor = len(self.text)
            if (self.state, self.sent, self.cursor) == before:
                return "".join(out["reasoning"]), "".join(out["content"]), calls

    def _search(self, markers: tuple[str, ...]) -> tuple[int, str]:
        pos, marker = find_first(self.text, markers, self.cursor)
        self.scanned += (pos if pos >= 0 else len(self.text)) - self.cursor
        return pos, marker

    def _hold(self, markers: tuple[str, ...], finished: bool) -> int:
        """Where text stops being safe to send: before a partial marker at the end."""
        partial = partial_any_len(self.text, markers)
        self.cursor = max(self.cursor, len(self.text) - partial)
        return max(self.sent, len(self.text) - (0 if finished else partial))

    def _top(self, out: dict[str, list[str]], finished: bool) -> None:
        pos, _ = self._search(OPENERS)
        if pos >= 0:
            out["content"].append(self.text[self.sent:pos])
            self.state, self.sent, self.cursor = "header", pos, pos
            self.header_start = pos
            return
        end = self._hold(OPENERS, finished)
        out["content"].append(self.text[self.sent:end])
        self.sent = end

    def _header(self, out: dict[str, list[str]], finished: bool) -> None:
        pos, _ = self._search((MESSAGE,))
        if pos < 0 or pos - self.header_start > MAX_HEADER:
            self._hold((MESSAGE,), finished)
            if finished or len(self.text) - self.header_start > MAX_HEADER:
                self.state = "plain"  # no header after all: all of it is content
            return
        header = self.text[self.header_start:pos]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1).startswith(FUNCTIONS) and self.with_tools:
            self.dest, self.call_name = "call", recipient.group(1)[len(FUNCTIONS):]
        elif channel is not None and channel.group(1) == "analysis":
            self.dest, self.saw_reasoning = "reasoning", True
        else:
            self.dest = "content"
        self.state, self.sent = "body", pos + len(MESSAGE)
        self.cursor = self.sent

    def _body(self, out: dict[str, list[str]], calls: list[ToolCall], finished: bool) -> None:
        pos, marker = self._search(ENDS)
        if pos < 0 and not finished:
            end = self._hold(ENDS, finished)
            if self.dest != "call":
                out[self.dest].append(self.text[self.sent:end])
                self.sent = end
            return
        end = len(self.text) if pos < 0 else pos
        after = len(self.text) if pos < 0 else pos + len(marker)
        if self.dest == "call":
            obj = json_object(self.text[self.sent:end].strip()) if self.call_name else None
            try:
                call = None if obj is None else ToolCall(self.call_name, render_arguments(obj))
            except (ValueError, TypeError):
                call = None
            if call is None:  # not a call after all: header, body and marker stay content
                out["content"].append(self.text[self.header_start:after])
            else:
                calls.append(call)
        else:
            out[self.dest].append(self.text[self.sent:end])
        self.state, self.sent, self.cursor = "top", after, after


def parse_harmony(text: str, with_tools: bool) -> HarmonyOutput:
    """The whole output at once: what a stream of it gives, joined."""
    stream = HarmonyStream(with_tools)
    reasoning, content, calls = stream.feed(text, finished=True)
    return HarmonyOutput(reasoning if stream.saw_reasoning else None, content, tuple(calls))
