"""DeepSeek-V3's and V3.1's tool calls (vLLM's ``deepseek_v3`` and ``deepseek_v31`` parsers), with
their exact markers (fullwidth bars U+FF5C, lower blocks U+2581)::

    deepseek_v3:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
                  ```json
                  {"city": "Paris"}
                  ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    deepseek_v31: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Knows nothing about HTTP, the engine or tokenizers.
"""

from __future__ import annotations

from inflight.runtime.server.openai.tool_parsers.blocks import BlockFormat
from inflight.runtime.server.openai.tool_parsers.common import ToolCall, Tools, json_object, render_arguments

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


def _valid_name(name: str) -> bool:
    return bool(name) and not any(c in name for c in "<>\n{")


def parse_v3_call(body: str, tools: Tools) -> ToolCall | None:
    """``function<｜tool▁sep｜>name\\n```json\\n{...}\\n```` (the fence may be left out)."""
    kind, sep, rest = body.partition(SEP)
    if not sep or kind.strip() != "function":
        return None
    name, _, args = rest.partition("\n")
    args = args.strip()
    if args.startswith(FENCE_OPEN) and args.endswith(FENCE_CLOSE) and len(args) >= len(FENCE_OPEN) + 3:
        args = args[len(FENCE_OPEN):-len(FENCE_CLOSE)]
    obj = json_object(args)
    name = name.strip()
    return ToolCall(name, render_arguments(obj)) if obj is not None and _valid_name(name) else None


def parse_v31_call(body: str, tools: Tools) -> ToolCall | None:
    """``name<｜tool▁sep｜>{...}``."""
    name, sep, args = body.partition(SEP)
    obj = json_object(args) if sep else None
    name = name.strip()
    return ToolCall(name, render_arguments(obj)) if obj is not None and _valid_name(name) else None


V3 = BlockFormat(sections=(CALLS_BEGIN,), call_open=CALL_BEGIN, call_close=CALL_END,
                 ignorable=(CALLS_END,), parse_call=parse_v3_call)
V31 = BlockFormat(sections=(CALLS_BEGIN,), call_open=CALL_BEGIN, call_close=CALL_END,
                  ignorable=(CALLS_END,), parse_call=parse_v31_call)
