"""GLM-4.5/4.6's tool calls (vLLM's ``glm45`` parser)::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Values are bare text, read by the tool's JSON schema (strings as written, anything else as JSON
when it is JSON; :func:`common.typed_value`). Knows nothing about HTTP, the engine or tokenizers.
"""

from __future__ import annotations

from typing import Any

from inflight.runtime.server.openai.tool_parsers.blocks import BlockFormat
from inflight.runtime.server.openai.tool_parsers.common import (
    ToolCall,
    Tools,
    param_type,
    render_arguments,
    typed_value,
)

KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


def parse_call(body: str, tools: Tools) -> ToolCall | None:
    """One ``<tool_call>`` body: the function's name, then key/value pairs, or None."""
    first = body.find(KEY)
    name = (body if first < 0 else body[:first]).strip()
    if not name or "<" in name or ">" in name or "\n" in name:
        return None
    args: dict[str, Any] = {}
    pos = len(body) if first < 0 else first
    while pos < len(body):
        start = body.find(KEY, pos)
        if start < 0:
            break
        key_end = body.find(KEY_END, start)
        value_start = body.find(VALUE, key_end) if key_end >= 0 else -1
        value_end = body.find(VALUE_END, value_start) if value_start >= 0 else -1
        if value_end < 0 or body[pos:start].strip() or body[key_end + len(KEY_END):value_start].strip():
            return None
        key = body[start + len(KEY):key_end].strip()
        if not key or key in args:
            return None
        args[key] = typed_value(body[value_start + len(VALUE):value_end], param_type(tools, name, key))
        pos = value_end + len(VALUE_END)
    if body[pos:].strip():
        return None
    return ToolCall(name, render_arguments(args))


FORMAT = BlockFormat(sections=("<tool_call>",), call_open="<tool_call>", call_close="</tool_call>",
                     ignorable=(), parse_call=parse_call)
