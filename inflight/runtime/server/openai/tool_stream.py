"""Tool calls found in a streamed output as it grows, in time linear in the output.

:class:`ToolStream` takes a choice's content deltas and hands back the content to send and the
tool calls completed by each delta. At every delta the calls it has handed out are exactly the
calls :func:`tool_calls.parse_tool_calls` finds in the whole text so far (the tests compare the
two on random splits), but it no longer re-parses the whole text on every delta: that was
quadratic (a 100k-character output in 4-character deltas was 25k parses of up to 100k
characters, on the event loop, stalling every other client). Instead:

* ``hermes``: each ``<tool_call>`` block is scanned once, left to right, by a bracket scanner that
  knows JSON strings (:class:`BracketScan`); a block's body is parsed once, when its top-level
  value closes (before that, and once anything but whitespace follows it, it holds no call);
  a closed block's calls are kept.
* ``required``: the same, the whole output being one value.
* ``llama3``: each ``{...}`` value is decoded once, when the scanner is back at depth 0.
* ``mistral``: the whole text is parsed again, but only while it is short (at most
  ``REPARSE_ALWAYS_CHARS``), once it has grown by a quarter since the last parse, and at the end:
  at most about five times the text in all. A call in a long mistral output may be sent a few
  deltas after it completed; the calls and their order are the same.
* ``named``: the arguments are passed through as they come.
* the formats of ``tool_parsers`` stream through their own scanners, which the whole-text parse
  runs too (``BlockStream``, ``PythonicStream``, ``HarmonyStream``): linear the same way.

``scanned`` counts the characters scanned and parsed, for tests that prove the work linear.
Knows nothing about HTTP, the engine or tokenizers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from inflight.runtime.json_text import MAX_DEPTH
from inflight.runtime.server.openai.tool_calls import (
    BLOCK_FORMATS,
    MARKERS,
    ToolCall,
    hermes_block_calls,
    llama3_call,
    parse_tool_calls,
    partial_marker_len,
    required_calls,
)
from inflight.runtime.server.openai.tool_parsers.blocks import BlockStream
from inflight.runtime.server.openai.tool_parsers.common import Tools
from inflight.runtime.server.openai.tool_parsers.harmony import HarmonyStream
from inflight.runtime.server.openai.tool_parsers.pythonic import PythonicStream

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
REPARSE_ALWAYS_CHARS = 1024
_NONSPACE = re.compile(r"\S")  # what str.strip() keeps
_NONSPACE_JSON = re.compile(r"[^ \t\n\r]")  # what json.loads does not skip
_OUTSIDE = re.compile(r'["\[\]{}]')
_INSIDE = re.compile(r'["\\]')
_DECODER = json.JSONDecoder()


class Work:
    """Characters scanned and parsed so far (shared by one stream's parts)."""

    def __init__(self) -> None:
        self.chars = 0


class BracketScan:
    """Bracket depth outside JSON strings, fed left to right (for text whose strings are all
    closed, what ``json_text.nesting_depth`` counts: depth never goes below 0)."""

    def __init__(self, work: Work) -> None:
        self.depth = self.max_depth = 0
        self.in_string = self.escape = False
        self.work = work

    def feed(self, text: str, start: int, end: int, stop_at_close: bool) -> int:
        """Scan ``text[start:end]``; the position after the first bracket that brought the depth
        back to 0 (a top-level value closed there; scanning stops if ``stop_at_close``), or -1."""
        closed, pos = -1, start
        self.work.chars += end - start
        while pos < end:
            if self.escape:  # the character after a backslash, in a string
                self.escape, pos = False, pos + 1
                continue
            match = (_INSIDE if self.in_string else _OUTSIDE).search(text, pos, end)
            if match is None:
                break
            pos, char = match.end(), match.group()
            if self.in_string:
                if char == '"':
                    self.in_string = False
                else:
                    self.escape = True
            elif char == '"':
                self.in_string = True
            elif char in "[{":
                self.depth += 1
                self.max_depth = max(self.max_depth, self.depth)
            elif self.depth > 0:
                self.depth -= 1
                if self.depth == 0 and closed < 0:
                    closed = pos
                    if stop_at_close:
                        break
        return closed


class _Value:
    """One region that must hold exactly one JSON value of calls (a hermes block's body, or the
    whole of a ``required`` output): scanned once, parsed once, when its value closes."""

    def __init__(self, start: int, nonspace: re.Pattern[str], parse: Callable[[str], list[ToolCall] | None],
                 work: Work) -> None:
        self.fed, self.nonspace, self.parse, self.work = start, nonspace, parse, work
        self.first = self.closed_at = -1
        self.dead = False  # holds no calls, whatever follows
        self.scan = BracketScan(work)
        self.calls: list[ToolCall] | None = None
        self.parsed = False

    def feed(self, text: str, end: int) -> None:
        start, self.fed = self.fed, max(self.fed, end)
        if self.dead or start >= end:
            return
        if self.first < 0:
            match = self.nonspace.search(text, start, end)
            if match is None:
                return
            self.first = start = match.start()
            if text[start] not in "[{":  # a scalar, or not JSON: never calls
                self.dead = True
                return
        if self.closed_at < 0:
            closed = self.scan.feed(text, start, end, stop_at_close=True)
            if closed < 0:
                return
            self.closed_at = start = closed
        self.work.chars += end - start
        if self.nonspace.search(text, start, end):  # more than one value
            self.dead = True

    def result(self, text: str) -> list[ToolCall] | None:
        """The calls, if what was fed is exactly one value of calls (and whitespace)."""
        if self.dead or self.closed_at < 0:
            return None
        if not self.parsed:
            self.work.chars += self.closed_at - self.first
            self.calls, self.parsed = self.parse(text[self.first:self.closed_at]), True
        return self.calls


class _HermesCalls:
    """``parse_hermes`` of the growing text, from its first ``<tool_call>`` at ``start``."""

    def __init__(self, start: int, work: Work) -> None:
        self.search, self.work = start, work
        self.block: _Value | None = None
        self.close_search = 0
        self.calls: list[ToolCall] = []
        self.failed = False

    def update(self, text: str) -> list[ToolCall]:
        while not self.failed:
            if self.block is None:
                pos = text.find(OPEN_TAG, self.search)
                if pos < 0:
                    self.work.chars += len(text) - self.search
                    self.search = max(self.search, len(text) - len(OPEN_TAG) + 1)
                    return list(self.calls)
                self.block = _Value(pos + len(OPEN_TAG), _NONSPACE, hermes_block_calls, self.work)
                self.close_search = pos + len(OPEN_TAG)
                continue
            end = text.find(CLOSE_TAG, self.close_search)
            if end >= 0:
                self.block.feed(text, end)
                calls = self.block.result(text)
                if calls is None:
                    self.failed = True
                    break
                self.calls += calls
                self.block, self.search = None, end + len(CLOSE_TAG)
                continue
            self.work.chars += len(text) - self.close_search
            self.close_search = max(self.close_search, len(text) - len(CLOSE_TAG) + 1)
            hold = partial_marker_len(text, CLOSE_TAG)
            self.block.feed(text, len(text) - hold)
            # Held back, the start of a close tag: not whitespace, so the open block is no call yet.
            current = None if hold else self.block.result(text)
            return [] if current is None else self.calls + current
        return []


class _RequiredCalls:
    """``parse_required`` of the growing text: one JSON array of calls."""

    def __init__(self, work: Work) -> None:
        self.value = _Value(0, _NONSPACE_JSON, required_calls, work)

    def update(self, text: str) -> list[ToolCall]:
        self.value.feed(text, len(text))
        return self.value.result(text) or []


class _Llama3Calls:
    """``parse_llama3`` of the growing text: ``{...}`` values separated by whitespace or ``;``,
    each decoded once, when the scanner is back at depth 0 outside strings."""

    def __init__(self, work: Work) -> None:
        self.work = work
        self.scan = BracketScan(work)
        self.base = -1  # where the first value starts (after <|python_tag|>)
        self.lead = 0  # where to look for it
        self.after_tag = False
        self.fed = self.pos = self.body_end = 0
        self.calls: list[ToolCall] = []
        self.failed = False

    def update(self, text: str) -> list[ToolCall]:
        if self.failed or not self._find_base(text):
            return []
        if self.fed < len(text):
            tail = text[self.fed:].rstrip()
            if tail:
                self.body_end = self.fed + len(tail)
            self.scan.feed(text, self.fed, len(text), stop_at_close=False)
            self.fed = len(text)
        if self.scan.max_depth > MAX_DEPTH:
            self.failed = True
            return []
        if self.scan.depth or self.scan.in_string:  # a value is still open: no calls yet
            return []
        while True:
            while self.pos < self.body_end and text[self.pos] in " \t\r\n;":
                self.pos += 1
            if self.pos >= self.body_end:
                return list(self.calls)
            call = None
            if text[self.pos] == "{":
                try:
                    obj, end = _DECODER.raw_decode(text, self.pos)
                except (json.JSONDecodeError, RecursionError, MemoryError):
                    obj = end = None
                self.work.chars += (end or len(text)) - self.pos
                call = None if end is None else llama3_call(obj)
            if call is None:
                self.failed = True
                return []
            self.calls.append(call)
            self.pos = end

    def _find_base(self, text: str) -> bool:
        if self.base >= 0:
            return True
        match = _NONSPACE.search(text, self.lead)
        self.work.chars += len(text) - self.lead
        if match is None:
            self.lead = len(text)
            return False
        if not self.after_tag and text.startswith(PYTHON_TAG, match.start()):
            self.after_tag, self.lead = True, match.start() + len(PYTHON_TAG)
            return self._find_base(text)
        self.base = self.fed = self.pos = match.start()
        if text[self.base] != "{":
            self.failed = True
            return False
        return True


class _Reparse:
    """The whole-text parser, run again only while the text is short, once it has grown by a
    quarter since the last run, and at the end (linear in all; see the module docstring)."""

    def __init__(self, mode: str, name: str | None, work: Work) -> None:
        self.mode, self.name, self.work = mode, name, work
        self.parsed_len = 0

    def update(self, text: str, finished: bool) -> list[ToolCall]:
        if not finished and len(text) > REPARSE_ALWAYS_CHARS and len(text) * 4 < self.parsed_len * 5:
            return []
        self.parsed_len = len(text)
        self.work.chars += len(text)
        return list(parse_tool_calls(self.mode, text, self.name).tool_calls)


class _HarmonyCalls:
    """Harmony's calls and content channels (``chat_output`` splits its reasoning off first;
    here, as in ``parse_tool_calls``, the analysis channel is not content)."""

    def __init__(self) -> None:
        self.stream = HarmonyStream(with_tools=True)

    @property
    def scanned(self) -> int:
        return self.stream.scanned

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        _, content, calls = self.stream.feed(delta, finished)
        return content, calls


def _format_stream(mode: str, tools: Tools) -> BlockStream | PythonicStream | _HarmonyCalls | None:
    """The scanner of a ``tool_parsers`` format, or None for the formats streamed here."""
    if mode in BLOCK_FORMATS:
        return BlockStream(BLOCK_FORMATS[mode], tools)
    if mode == "pythonic":
        return PythonicStream()
    return _HarmonyCalls() if mode == "harmony" else None


class ToolStream:
    """Content deltas and completed tool calls from streamed content text."""

    def __init__(self, mode: str, name: str | None, tools: Tools = ()) -> None:
        self.mode, self.name = mode, name
        self._format = _format_stream(mode, tools)
        self.text = ""
        self.sent = 0  # chars of text handed out (as content, or as named-call arguments)
        self.in_tools = mode in ("named", "required")
        self.num_calls = 0
        self.work = Work()
        self._lead = 0  # llama3: where to look for the first non-space character
        self._plain = False  # llama3: known to be content, not calls
        self._calls: _HermesCalls | _RequiredCalls | _Llama3Calls | _Reparse | None = None
        if mode == "required":
            self._calls = _RequiredCalls(self.work)

    @property
    def scanned(self) -> int:
        """Characters scanned and parsed so far."""
        return self.work.chars + (self._format.scanned if self._format is not None else 0)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall], str]:
        """(content delta, newly completed calls, named-call argument delta)."""
        if self._format is not None:
            content, calls = self._format.feed(delta, finished)
            self.num_calls += len(calls)
            return content, calls, ""
        text, self.text = self.text, ""
        text += delta  # a local with one reference: CPython grows it in place instead of copying
        self.text = text
        if self.mode == "named":
            args, self.sent = text[self.sent:], len(text)
            return "", [], args
        content = "" if self.in_tools else self._content_until_tools(finished)
        calls: list[ToolCall] = []
        if self.in_tools:
            found = self._found_calls(finished)
            calls = found[self.num_calls:]
            self.num_calls += len(calls)
            if finished and self.num_calls == 0:  # not a tool call after all: it was content
                content, self.sent = content + text[self.sent:], len(text)
        return content, calls, ""

    def _found_calls(self, finished: bool) -> list[ToolCall]:
        """The calls ``parse_tool_calls`` finds in the text so far, computed incrementally."""
        if self._calls is None:
            if self.mode == "hermes":
                self._calls = _HermesCalls(self.sent, self.work)
            elif self.mode == "llama3":
                self._calls = _Llama3Calls(self.work)
            else:
                self._calls = _Reparse(self.mode, self.name, self.work)
        if isinstance(self._calls, _Reparse):
            return self._calls.update(self.text, finished)
        return self._calls.update(self.text)

    def _content_until_tools(self, finished: bool) -> str:
        if self.mode == "llama3":
            return self._llama3_content(finished)
        marker = MARKERS[self.mode]
        self.work.chars += len(self.text) - self.sent
        idx = self.text.find(marker, self.sent)
        if idx >= 0:
            out, self.sent, self.in_tools = self.text[self.sent:idx], idx, True
            return out
        hold = 0 if finished else partial_marker_len(self.text, marker)
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def _llama3_content(self, finished: bool) -> str:
        """A Llama 3 reply is calls when it starts (after whitespace) with ``{`` or the python tag."""
        if not self._plain:
            match = _NONSPACE.search(self.text, self._lead)
            self.work.chars += len(self.text) - self._lead
            body = "" if match is None else self.text[match.start():match.start() + len(PYTHON_TAG)]
            self._lead = len(self.text) if match is None else match.start()
            if body.startswith(("{", PYTHON_TAG)):
                self.in_tools = True
                return ""
            if not finished and (not body or PYTHON_TAG.startswith(body)):
                return ""
            self._plain = True
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
