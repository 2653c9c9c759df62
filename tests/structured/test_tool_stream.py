"""Streamed tool calls found incrementally (``tool_stream.ToolStream``): at every delta the same
content and calls as parsing the whole text so far (the way it was done before, kept here as
the reference), on random texts split at random points; and the work linear in the output,
counted in characters handed to the JSON parser and scanned (not timed)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from inflight.runtime import json_text
from inflight.runtime.server.openai import tool_calls
from inflight.runtime.server.openai.tool_calls import MARKERS, ToolCall, parse_tool_calls, partial_marker_len
from inflight.runtime.server.openai.tool_stream import REPARSE_ALWAYS_CHARS, ToolStream

MODES = ["hermes", "llama3", "mistral", "required"]
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "</tool_", "<tool_", '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "g", "parameters": {"q": "]}"}}', '[{"name": "h", "parameters": {}}]', '{"name": "e"}',
    '{"name": "s", "arguments": "{\\"x\\": 2}"}', "{", "}", "[", "]", '"', "\\", '\\"', " ", "\n", "\x0c",
    ";", "<|python_tag|>", "<|py", "[TOOL_CALLS]", "f[ARGS]", "x", '"}"', "1", "true", "[]", "{}", "hi ",
    '"</tool_call>"', ",", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', '[TOOL_CALLS]f[ARGS]{"a": 1}',
    '{"name": "g", "parameters": {}};', '[{"name": "r", "parameters": {}}]',
]  # fmt: skip


class ReferenceStream:
    """The streaming parser as it was: the whole text parsed again on every delta."""

    def __init__(self, mode: str, name: str | None = None) -> None:
        self.mode, self.name, self.text, self.sent = mode, name, "", 0
        self.in_tools, self.num_calls = mode in ("named", "required"), 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall], str]:
        self.text += delta
        content = "" if self.in_tools else self._content_until_tools(finished)
        calls: list[ToolCall] = []
        if self.in_tools:
            parsed = parse_tool_calls(self.mode, self.text, self.name)
            calls = list(parsed.tool_calls[self.num_calls:])
            self.num_calls += len(calls)
            if finished and self.num_calls == 0:
                content, self.sent = content + self.text[self.sent:], len(self.text)
        return content, calls, ""

    def _content_until_tools(self, finished: bool) -> str:
        if self.mode == "llama3":
            body = self.text.lstrip()
            if body.startswith(("{", "<|python_tag|>")):
                self.in_tools = True
                return ""
            if not finished and (not body or "<|python_tag|>".startswith(body)):
                return ""
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        marker = MARKERS[self.mode]
        idx = self.text.find(marker, self.sent)
        if idx >= 0:
            out, self.sent, self.in_tools = self.text[self.sent:idx], idx, True
            return out
        hold = 0 if finished else partial_marker_len(self.text, marker)
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out


def _splits(text: str, rng: random.Random) -> Iterator[str]:
    pos = 0
    while pos < len(text):
        step = rng.choice((1, 1, 2, 3, 5, 8, 40))
        yield text[pos:pos + step]
        pos += step


def _run(stream: Any, deltas: list[str]) -> list[tuple[str, list[ToolCall], str]]:
    return [stream.feed(d, i == len(deltas) - 1) for i, d in enumerate(deltas)]


def test_every_delta_matches_parsing_the_whole_text() -> None:
    rng = random.Random(19)
    checked = 0
    for _ in range(2500):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14)))
        if rng.random() < 0.3:
            text = rng.choice(["", "  ", "\n<|python_tag|>", "ok "]) + text
        deltas = list(_splits(text, rng))
        for mode in MODES:
            assert _run(ToolStream(mode, None), deltas) == _run(ReferenceStream(mode), deltas), (mode, text, deltas)
            checked += 1
    assert checked == 10000


@pytest.mark.parametrize("mode", MODES)
def test_well_formed_calls_split_everywhere(mode: str) -> None:
    one = {"hermes": '<tool_call>\n{"name": "f", "arguments": {"a": "x}]"}}\n</tool_call>',
           "llama3": '{"name": "f", "parameters": {"a": "x}]"}}; ',
           "mistral": '[TOOL_CALLS]f[ARGS]{"a": "x}]"}',
           "required": ""}[mode]
    text = "Sure. " * (mode in ("hermes", "mistral")) + one * 3
    if mode == "required":
        text = '[{"name": "f", "parameters": {"a": "x}]"}}, {"name": "g", "parameters": {}}]'
    for size in range(1, 9):
        deltas = [text[i:i + size] for i in range(0, len(text), size)]
        ours, reference = _run(ToolStream(mode, None), deltas), _run(ReferenceStream(mode), deltas)
        assert ours == reference
        assert sum(len(calls) for _, calls, _ in ours) >= 2


@pytest.fixture
def parsed_chars(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Characters handed to the JSON parser and to the nesting measure, whoever calls them."""
    count = [0]
    raw_decode = json.JSONDecoder.raw_decode
    nesting_depth = json_text.nesting_depth

    def counting_raw_decode(self: json.JSONDecoder, s: str, idx: int = 0) -> Any:
        try:
            obj, end = raw_decode(self, s, idx)
        except json.JSONDecodeError:
            count[0] += len(s) - idx
            raise
        count[0] += end - idx
        return obj, end

    def counting_depth(text: str) -> int:
        count[0] += len(text)
        return nesting_depth(text)

    monkeypatch.setattr(json.JSONDecoder, "raw_decode", counting_raw_decode)
    monkeypatch.setattr(json_text, "nesting_depth", counting_depth)
    monkeypatch.setattr(tool_calls, "nesting_depth", counting_depth)
    return count


N = 100_000
CALL = {"hermes": '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "llama3": '{"name": "f", "parameters": {}}; ',
        "required": '{"name": "f", "parameters": {}}, ', "mistral": '{"name": "f", "arguments": {}}, '}
ADVERSARIAL = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": "' + "}]" * (N // 2), 0),  # an open string of closers
    ("hermes", "<tool_call>" + "{}" * (N // 2), 0),  # a value closing every 2 characters
    ("hermes", "<tool_call>" + "{" * N, 0),  # deeper and deeper
    ("hermes", "ok " + CALL["hermes"] * (N // len(CALL["hermes"])), N // len(CALL["hermes"])),
    ("hermes", "<tool_call>" + " " * N + "{", 0),  # whitespace that is not at the end
    ("llama3", '{"name": "f", "parameters": {"x": "' + "{" * N, 0),
    ("llama3", CALL["llama3"] * (N // len(CALL["llama3"])), N // len(CALL["llama3"])),
    ("llama3", " " * N + "{", 0),
    ("required", "[" + CALL["required"] * (N // len(CALL["required"])) + '{"name": "f", "parameters": {}}]',
     N // len(CALL["required"]) + 1),
    ("required", "[" + "[]" * (N // 2), 0),
]  # fmt: skip


@pytest.mark.parametrize(("mode", "text", "num_calls"), ADVERSARIAL, ids=[f"{c[0]}-{i}" for i, c in enumerate(ADVERSARIAL)])
def test_the_work_is_linear_in_the_output(parsed_chars: list[int], mode: str, text: str, num_calls: int) -> None:
    stream = ToolStream(mode, None)
    deltas = [text[i:i + 3] for i in range(0, len(text), 3)]
    calls = [c for _, found, _ in _run(stream, deltas) for c in found]
    assert len(calls) == num_calls
    # Re-parsing on every delta would hand the parser ~len(text)**2 / 6 characters (1.7e9 here).
    assert parsed_chars[0] <= 6 * len(text), parsed_chars[0]
    assert stream.scanned <= 6 * len(text), stream.scanned


@pytest.mark.parametrize("size", [N // 2, N])
def test_a_long_mistral_output_is_parsed_a_bounded_number_of_times(parsed_chars: list[int], size: int) -> None:
    """mistral is parsed whole again, but only on every delta up to ``REPARSE_ALWAYS_CHARS``, then
    when grown by a quarter: a constant plus ~10 characters per character (whole parse and depth)."""
    text = "[TOOL_CALLS][" + CALL["mistral"] * (size // len(CALL["mistral"])) + '{"name": "f", "arguments": {}}]'
    stream = ToolStream("mistral", None)
    calls = [c for _, found, _ in _run(stream, [text[i:i + 3] for i in range(0, len(text), 3)]) for c in found]
    assert len(calls) == size // len(CALL["mistral"]) + 1
    bound = REPARSE_ALWAYS_CHARS**2 + 12 * len(text)
    assert parsed_chars[0] <= bound and stream.scanned <= bound, (parsed_chars[0], stream.scanned)
