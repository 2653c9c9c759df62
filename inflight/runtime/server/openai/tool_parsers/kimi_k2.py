"""Kimi-K2's tool calls (vLLM's ``kimi_k2`` parser); the id the model writes is the call's id::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The singular section markers some checkpoints write (``<|tool_call_section_begin|>``) are read
too. Knows nothing about HTTP, the engine or tokenizers.
"""

from __future__ import annotations

from inflight.runtime.server.openai.tool_parsers.blocks import BlockFormat
from inflight.runtime.server.openai.tool_parsers.common import ToolCall, Tools, json_object, render_arguments

SECTIONS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def parse_call(body: str, tools: Tools) -> ToolCall | None:
    """``functions.name:index<|tool_call_argument_begin|>{...}``."""
    call_id, sep, args = body.partition(ARGS_BEGIN)
    call_id = call_id.strip()
    head, colon, index = call_id.rpartition(":")
    if not sep or not colon or not index.isdigit():
        return None
    name = head.removeprefix("functions.")
    obj = json_object(args)
    if obj is None or not name or any(c in call_id for c in " <>\n{"):
        return None
    return ToolCall(name, render_arguments(obj), call_id)


FORMAT = BlockFormat(sections=SECTIONS, call_open=CALL_BEGIN, call_close=CALL_END,
                     ignorable=SECTION_ENDS, parse_call=parse_call)
