"""One scanner for the formats whose calls sit between markers (qwen3_coder, glm45, deepseek_v3,
deepseek_v31, kimi_k2), fed the whole text at once or delta by delta.

A :class:`BlockFormat` names the markers: ``sections`` (where the calls start: text before the
first one is content), ``call_open`` / ``call_close`` around each call, and ``ignorable`` markers
that may sit between calls (a section's end). Its ``parse_call`` reads one call's body.

What the scanner makes of a text (the same whole or streamed, since :func:`parse_blocks` is the
stream fed everything at once):

* content: the text before the first section marker, plus any text between calls other than
  whitespace and ignorable markers;
* calls: each block whose body parses, in order, sent as soon as its ``call_close`` arrives (a
  last block left open is read at the end: the model may stop before its close marker);
* from the first block that does not parse on, the rest of the text is content, as written;
  output with no call at all is content whole. Nothing the model wrote is dropped.

A close marker inside a call's arguments ends the call there, as vLLM's patterns do (the body
then fails to parse and the text stays content). Every position is searched once: the work is
linear in the text, whatever the deltas. Knows nothing about HTTP, the engine or tokenizers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from inflight.runtime.server.openai.tool_parsers.common import (
    ParsedOutput,
    ToolCall,
    Tools,
    content_or_none,
    find_first,
    partial_any_len,
)

CallParser = Callable[[str, Tools], "ToolCall | None"]


@dataclass(frozen=True, slots=True)
class BlockFormat:
    sections: tuple[str, ...]  # where the calls start
    call_open: str
    call_close: str
    ignorable: tuple[str, ...]  # markers between calls that are not content
    parse_call: CallParser  # one call's body -> the call, or None (never raises)


class BlockStream:
    """Content deltas and completed calls from growing text in one :class:`BlockFormat`."""

    def __init__(self, fmt: BlockFormat, tools: Tools) -> None:
        self.fmt, self.tools = fmt, tools
        self.text = ""
        self.state = "content"  # content -> between <-> call; failed (all the rest is content)
        self.sent = 0  # text before this is content sent or calls read
        self.cursor = 0  # where the next marker search starts
        self.gap = ""  # text between the previous call and this block's open marker
        self.body_start = 0
        self.num_calls = 0
        self.scanned = 0  # characters searched or parsed (the work, for tests)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """(content delta, calls completed by this delta)."""
        text, self.text = self.text, ""
        text += delta
        self.text = text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            before = (self.state, self.sent, self.cursor)
            if self.state == "content":
                self._content(out, finished)
            elif self.state == "between":
                self._between(out, finished)
            elif self.state == "call":
                self._call(out, calls, finished)
            else:
                out.append(self.text[self.sent:])
                self.sent = self.cursor = len(self.text)
            if (self.state, self.sent, self.cursor) == before:
                return "".join(out), calls

    def _search(self, markers: tuple[str, ...]) -> int:
        pos, _ = find_first(self.text, markers, self.cursor)
        self.scanned += (pos if pos >= 0 else len(self.text)) - self.cursor
        return pos

    def _hold_cursor(self, markers: tuple[str, ...]) -> None:
        """Nothing found: search again only from a marker's start left at the end of the text."""
        self.cursor = max(self.cursor, len(self.text) - partial_any_len(self.text, markers))

    def _content(self, out: list[str], finished: bool) -> None:
        pos = self._search(self.fmt.sections)
        if pos >= 0:
            out.append(self.text[self.sent:pos])
            self.state, self.sent, self.cursor = "between", pos, pos
            return
        hold = 0 if finished else partial_any_len(self.text, self.fmt.sections)
        end = max(self.sent, len(self.text) - hold)
        out.append(self.text[self.sent:end])
        self.sent = end
        self._hold_cursor(self.fmt.sections)

    def _between(self, out: list[str], finished: bool) -> None:
        pos = self._search((self.fmt.call_open,))
        if pos >= 0:
            self.gap = self.text[self.sent:pos]
            self.state, self.sent = "call", pos
            self.body_start = self.cursor = pos + len(self.fmt.call_open)
            return
        self._hold_cursor((self.fmt.call_open,))
        if finished:
            rest = self.text[self.sent:]
            out.append(self._cleaned(rest) if self.num_calls else rest)
            self.sent = self.cursor = len(self.text)

    def _call(self, out: list[str], calls: list[ToolCall], finished: bool) -> None:
        end = self._search((self.fmt.call_close,))
        if end < 0:
            self._hold_cursor((self.fmt.call_close,))
            if not finished:
                return
            body = self.text[self.body_start:].rstrip()
            for marker in self.fmt.ignorable:  # a section end after an unclosed last call
                if body.endswith(marker):
                    body = body[:-len(marker)].rstrip()
            close_end = len(self.text)
        else:
            body, close_end = self.text[self.body_start:end], end + len(self.fmt.call_close)
        self.scanned += len(body)
        call = self._parse(body)
        if call is None:  # this block and all that follows stay text
            out.append(self.gap + self.text[self.sent:])
            self.state, self.sent = "failed", len(self.text)
            self.cursor = self.sent
            return
        out.append(self._cleaned(self.gap))
        calls.append(call)
        self.num_calls += 1
        self.state, self.sent, self.cursor = "between", close_end, close_end

    def _parse(self, body: str) -> ToolCall | None:
        try:
            return self.fmt.parse_call(body, self.tools)
        except (ValueError, TypeError, RecursionError, MemoryError):
            return None

    def _cleaned(self, gap: str) -> str:
        """Text between calls, less ignorable markers and whitespace ("" when nothing is left)."""
        for marker in (*self.fmt.sections, *self.fmt.ignorable):
            gap = gap.replace(marker, "")
        return gap if gap.strip() else ""


def parse_blocks(fmt: BlockFormat, text: str, tools: Tools) -> ParsedOutput:
    """The whole text at once: the same content and calls a stream of it gives."""
    content, calls = BlockStream(fmt, tools).feed(text, finished=True)
    return ParsedOutput(content_or_none(content), tuple(calls))
