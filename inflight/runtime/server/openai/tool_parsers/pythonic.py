"""Python-call-list tool calls (vLLM's ``pythonic`` parser; Llama 3.2/4, ToolACE)::

    [get_weather(city='Paris', days=2), get_time(tz="utc")]

The whole reply is the list, read with ``ast`` (parsed, never evaluated: only literal keyword
values, through ``ast.literal_eval``); anything else (positional arguments, expressions, names,
values JSON cannot hold, nesting past Python's parser limit) leaves the reply as content.
Streamed, a reply that starts with ``[`` is held and read when it ends (the list is the whole
reply, so its calls are known only then); one that starts with anything else is content as it
comes. Knows nothing about HTTP, the engine or tokenizers.
"""

from __future__ import annotations

import ast

from inflight.runtime.server.openai.tool_parsers.common import (
    ParsedOutput,
    ToolCall,
    content_or_none,
    render_arguments,
)


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        base = _name(func.value)
        return None if base is None else f"{base}.{func.attr}"
    return None


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _name(node.func)
    if name is None or any(k.arg is None for k in node.keywords):
        return None
    args = {str(k.arg): ast.literal_eval(k.value) for k in node.keywords}
    return ToolCall(name, render_arguments(_jsonable(args)))


def _jsonable(value: object) -> object:
    """Tuples as lists; anything JSON cannot hold raises ``TypeError``."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("non-string key")
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"{type(value).__name__} is not JSON")


def pythonic_calls(text: str) -> list[ToolCall] | None:
    """The calls of a reply that is one Python list of calls, or None."""
    body = text.strip()
    if not (body.startswith("[") and body.endswith("]")):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [_call(node) for node in tree.elts]
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return None if None in calls else [c for c in calls if c is not None]


def parse_pythonic(text: str) -> ParsedOutput:
    calls = pythonic_calls(text)
    return ParsedOutput(content_or_none(text), ()) if calls is None else ParsedOutput(None, tuple(calls))


class PythonicStream:
    """Content deltas and calls of a streamed pythonic reply (see the module docstring)."""

    def __init__(self) -> None:
        self.text = ""
        self.state = "pending"  # pending (only whitespace yet) -> held (starts with "[") | content
        self.sent = 0
        self.scanned = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCall]]:
        text, self.text = self.text, ""
        text += delta
        self.text = text
        if self.state == "pending":
            stripped = self.text.lstrip()
            if stripped:
                self.state = "held" if stripped.startswith("[") else "content"
            elif not finished:
                return "", []
        if self.state == "held":
            if not finished:
                return "", []
            self.scanned += len(self.text)
            calls = pythonic_calls(self.text)
            if calls is not None:
                self.sent = len(self.text)
                return "", calls
        out, self.sent = self.text[self.sent:], len(self.text)
        return out, []
