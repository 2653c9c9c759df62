"""Qwen3-Coder's XML-style tool calls (vLLM's ``qwen3_coder`` parser)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are bare text, read by the tool's JSON schema (:func:`common.typed_value`; one
newline after ``<parameter=x>`` and one before ``</parameter>`` belong to the markup, as in the
model's template; a parameter the schema does not type stays a string, as in vLLM). Knows nothing about HTTP, the engine or tokenizers.
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

FUNCTION, PARAM, PARAM_END, FUNCTION_END = "<function=", "<parameter=", "</parameter>", "</function>"


def parse_call(body: str, tools: Tools) -> ToolCall | None:
    """One ``<tool_call>`` body: ``<function=name>`` and its parameters, or None."""
    body = body.strip()
    if not body.startswith(FUNCTION):
        return None
    head_end = body.find(">")
    name = body[len(FUNCTION):head_end].strip() if head_end >= 0 else ""
    if not name or "<" in name or "\n" in name:
        return None
    rest = body[head_end + 1:].rstrip()
    rest = rest[:-len(FUNCTION_END)] if rest.endswith(FUNCTION_END) else rest  # may be left out
    args: dict[str, Any] = {}
    pos = 0
    while True:
        start = rest.find(PARAM, pos)
        if start < 0:
            break
        if rest[pos:start].strip():  # text between parameters: not this format
            return None
        key_end = rest.find(">", start)
        value_end = rest.find(PARAM_END, key_end + 1) if key_end >= 0 else -1
        if value_end < 0:
            return None
        key = rest[start + len(PARAM):key_end].strip()
        value = rest[key_end + 1:value_end].removeprefix("\n").removesuffix("\n")
        if not key or key in args:
            return None
        args[key] = typed_value(value, param_type(tools, name, key) or "string")  # undeclared: text
        pos = value_end + len(PARAM_END)
    if rest[pos:].strip():
        return None
    return ToolCall(name, render_arguments(args))


FORMAT = BlockFormat(sections=("<tool_call>",), call_open="<tool_call>", call_close="</tool_call>",
                     ignorable=(), parse_call=parse_call)
