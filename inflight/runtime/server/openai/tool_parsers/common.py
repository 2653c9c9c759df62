"""What every tool-call parser returns, and the one rendering of arguments.

``ToolCall.arguments`` is always :func:`render_arguments` of the decoded object: compact JSON
(``{"city":"Paris"}``, no spaces, non-ASCII kept), which is what OpenAI's API returns and what the
grammar of a forced call (``required``, a named function) generates, so a call's arguments read
the same whatever the ``tool_choice``, the format or streaming. :func:`param_type` reads a
parameter's JSON-schema type off the request's tools, for formats that write values as bare text
(qwen3_coder, glm45). Knows nothing about HTTP, the engine or tokenizers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inflight.runtime.json_text import loads_limited

Tools = Sequence[dict[str, Any]]  # the request's ``tools`` (validated by tool_requests)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (render_arguments)
    call_id: str | None = None  # the id the model wrote (kimi_k2's functions.name:0), else None


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None  # None when there is no text besides the calls
    tool_calls: tuple[ToolCall, ...]


def render_arguments(args: dict[str, Any]) -> str:
    """Arguments as OpenAI returns them: compact JSON, non-ASCII as is. Raises ``ValueError`` for
    what JSON cannot hold (NaN, infinities), ``TypeError`` for non-JSON values."""
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def content_or_none(text: str) -> str | None:
    return text if text.strip() else None


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def partial_any_len(text: str, markers: Sequence[str]) -> int:
    """The longest :func:`partial_marker_len` of ``text`` over ``markers``."""
    return max((partial_marker_len(text, m) for m in markers), default=0)


def find_first(text: str, markers: Sequence[str], start: int) -> tuple[int, str]:
    """The earliest of ``markers`` in ``text`` from ``start``: (position, marker), or (-1, "")."""
    best, found = -1, ""
    for marker in markers:
        pos = text.find(marker, start)
        if pos >= 0 and (best < 0 or pos < best):
            best, found = pos, marker
    return best, found


def param_type(tools: Tools, function: str, param: str) -> str | None:
    """The JSON-schema ``type`` of ``function``'s parameter ``param`` in the request's tools
    (the first non-null one of a list of types), or None when the schema does not say."""
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or fn.get("name") != function:
            continue
        props = (fn.get("parameters") or {}).get("properties")
        spec = props.get(param) if isinstance(props, dict) else None
        kind = spec.get("type") if isinstance(spec, dict) else None
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), None)
        return kind if isinstance(kind, str) else None
    return None


def json_object(text: str) -> dict[str, Any] | None:
    """``text`` as a JSON object, or None (not JSON, not an object, nested past the limit)."""
    try:
        value = loads_limited(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def typed_value(text: str, kind: str | None) -> Any:
    """A parameter written as bare text, read as its schema ``kind`` says: strings as written,
    integers, numbers and booleans when they read as one, anything else as JSON when it is JSON;
    otherwise the text itself (nothing the model wrote is dropped)."""
    if kind == "string":
        return text
    stripped = text.strip()
    if kind == "integer":
        try:
            return int(stripped)
        except ValueError:
            return text
    if kind == "number":
        try:
            number = float(stripped)
        except ValueError:
            return text
        return int(number) if number.is_integer() and stripped.lstrip("-").isdigit() else number
    if kind == "boolean" and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if kind == "null" and stripped.lower() in ("null", "none"):
        return None
    try:
        return loads_limited(stripped)
    except ValueError:
        return text
