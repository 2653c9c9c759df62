"""Tool calls in model output: one pure parser per model family, plus a streaming extractor.

Families (what the model writes when it calls a tool; ``TOOL_CALL_PARSERS`` maps vLLM's
``--tool-call-parser`` names onto them, and :func:`detect_family` reads one off a chat template):

* ``hermes`` (Qwen2/2.5/3, Hermes, our qwen demo template, ``smollm2-tools``):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call (a block
  holding a JSON array of calls is read too: the form SmolLM2's function-calling prompt asks for).
* ``llama3`` (Llama 3.1+ JSON tool calling): the whole reply is ``{"name": ..., "parameters":
  {...}}`` (optionally after ``<|python_tag|>``), several calls separated by ``;``.
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` per call.

* the formats of :mod:`.tool_parsers` (one module each): ``qwen3_coder``, ``harmony`` (gpt-oss,
  vLLM's ``openai``), ``deepseek_v3``, ``deepseek_v31``, ``kimi_k2``, ``glm45``, ``pythonic``.

Arguments always come back in one rendering, compact JSON (``tool_parsers.common.render_arguments``).
Plus two formats of our own for forced calls, whose output the grammar engine constrains:
``required`` (a JSON array of ``{"name", "parameters"}``) and ``named`` (the arguments object
alone). Text that does not parse as a call stays content: nothing the model wrote is dropped
silently. Every parser runs in time linear in the text (plain string scans, no backtracking
patterns) and never raises on what a model writes (JSON nested past ``MAX_DEPTH``, or too large
to parse in the memory left, is text, not a call). Knows nothing about HTTP, the engine or tokenizers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

from inflight.runtime.json_text import MAX_DEPTH, loads_limited, nesting_depth
from inflight.runtime.server.openai.tool_parsers import deepseek, glm45, harmony, kimi_k2, qwen3_coder
from inflight.runtime.server.openai.tool_parsers.blocks import BlockFormat, parse_blocks
from inflight.runtime.server.openai.tool_parsers.common import (
    ParsedOutput,
    ToolCall,
    Tools,
    partial_marker_len,
    render_arguments,
)
from inflight.runtime.server.openai.tool_parsers.harmony import is_harmony, parse_harmony
from inflight.runtime.server.openai.tool_parsers.pythonic import parse_pythonic

__all__ = ["MARKERS", "TOOL_CALL_PARSERS", "BLOCK_FORMATS", "ParsedOutput", "ToolCall", "detect_family", "format_markers",
           "parse_tool_calls", "partial_marker_len", "renders_tools", "tool_parser_choices"]

_MISTRAL_ARGS = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*\[ARGS\]", re.DOTALL)
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
# vLLM's ``--tool-call-parser`` names that inflight implements -> the family parsed here.
TOOL_CALL_PARSERS = {"hermes": "hermes", "llama3_json": "llama3", "mistral": "mistral",
                     "qwen3_coder": "qwen3_coder", "openai": "harmony", "deepseek_v3": "deepseek_v3",
                     "deepseek_v31": "deepseek_v31", "kimi_k2": "kimi_k2", "glm45": "glm45", "pythonic": "pythonic"}
# The families whose calls sit between begin/end markers, read by tool_parsers.blocks.
BLOCK_FORMATS: dict[str, BlockFormat] = {
    "qwen3_coder": qwen3_coder.FORMAT, "glm45": glm45.FORMAT, "deepseek_v3": deepseek.V3,
    "deepseek_v31": deepseek.V31, "kimi_k2": kimi_k2.FORMAT,
}


def format_markers(family: str) -> tuple[str, ...]:
    """The marker strings a family's parser reads in the output text. Where a tokenizer makes any
    of them a special token (gpt-oss's ``<|channel|>``, Mistral's ``[TOOL_CALLS]``, Llama's
    ``<|python_tag|>``), the request's text must keep special tokens or the parser never sees them."""
    if family in BLOCK_FORMATS:
        fmt = BLOCK_FORMATS[family]
        extra = (deepseek.SEP,) if family.startswith("deepseek") else ()
        return (*fmt.sections, fmt.call_open, fmt.call_close, *fmt.ignorable, *extra)
    return {
        "hermes": ("<tool_call>", "</tool_call>"),
        "mistral": ("[TOOL_CALLS]", "[ARGS]"),
        "llama3": ("<|python_tag|>",),
        "harmony": (harmony.START, harmony.CHANNEL, harmony.MESSAGE, *harmony.ENDS, "<|constrain|>"),
    }.get(family, ())


def tool_parser_choices() -> str:
    """What ``--tool-call-parser`` accepts, in one phrase (for its refusals)."""
    return (f"inflight parses {', '.join(TOOL_CALL_PARSERS)} tool calls (vLLM's other parsers and "
            "plugins are not implemented)")


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template writes the request's tools into the prompt (it reads ``tools``)."""
    return "tools" in (chat_template or "")


def detect_family(chat_template: str | None) -> str:
    """The tool-call format a chat template teaches its model (hermes when it says nothing)."""
    template = chat_template or ""
    if is_harmony(template):
        return "harmony"
    if kimi_k2.CALL_BEGIN in template:
        return "kimi_k2"
    if deepseek.SEP in template:
        return "deepseek_v3" if deepseek.FENCE_OPEN in template else "deepseek_v31"
    if "<arg_key>" in template:
        return "glm45"
    if qwen3_coder.FUNCTION in template:
        return "qwen3_coder"
    if "[func_name1(" in template:  # Llama 3.2's pythonic tool-calling prompt
        return "pythonic"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = loads_limited(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    try:
        return ToolCall(obj["name"], render_arguments(args))
    except ValueError:  # NaN or an infinity: no JSON
        return None


def _content(text: str) -> str | None:
    return text if text.strip() else None


def _hermes_blocks(text: str, start: int) -> Iterator[str]:
    """The stripped body of each ``<tool_call>`` block from ``start`` (the last may be unclosed)."""
    open_tag, close_tag = "<tool_call>", "</tool_call>"
    pos = text.find(open_tag, start)
    while pos >= 0:
        body_start = pos + len(open_tag)
        end = text.find(close_tag, body_start)
        if end < 0:
            yield text[body_start:].strip()
            return
        yield text[body_start:end].strip()
        pos = text.find(open_tag, end + len(close_tag))


def _loads(text: str) -> Any:
    """Model output as JSON, or None (malformed, or nested past the limit)."""
    try:
        return loads_limited(text)
    except ValueError:
        return None


def hermes_block_calls(body: str) -> list[ToolCall] | None:
    """The calls in one ``<tool_call>`` block's stripped body (an object, or an array of them),
    or None when it is not one."""
    obj = _loads(body)
    calls = [_call(o) for o in obj] if isinstance(obj, list) and obj else [_call(obj)]
    return None if None in calls else [c for c in calls if c is not None]


def parse_hermes(text: str) -> ParsedOutput:
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedOutput(_content(text), ())
    calls: list[ToolCall] = []
    for body in _hermes_blocks(text, start):
        block = hermes_block_calls(body)
        if block is None:
            return ParsedOutput(_content(text), ())
        calls += block
    return ParsedOutput(_content(text[:start]), tuple(calls))


def llama3_call(obj: Any) -> ToolCall | None:
    """One decoded Llama 3 call (``parameters``, or ``arguments``), or None."""
    return _call(obj, ("parameters", "arguments"))


def parse_llama3(text: str) -> ParsedOutput:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].lstrip()
    if not body.startswith("{") or nesting_depth(body) > MAX_DEPTH:
        return ParsedOutput(_content(text), ())
    decoder = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return ParsedOutput(_content(text), ())
        call = llama3_call(obj)
        if call is None:
            return ParsedOutput(_content(text), ())
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ParsedOutput(None, tuple(calls))


def parse_mistral(text: str) -> ParsedOutput:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return ParsedOutput(_content(text), ())
    rest = text[start + len("[TOOL_CALLS]"):].strip()
    if nesting_depth(rest) > MAX_DEPTH:
        return ParsedOutput(_content(text), ())
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    try:
        if rest.startswith("["):
            objs, _ = decoder.raw_decode(rest)
            calls = [c for c in (_call(o) for o in (objs if isinstance(objs, list) else [])) if c is not None]
            if not isinstance(objs, list) or len(calls) != len(objs):
                return ParsedOutput(_content(text), ())
        else:
            for part in filter(str.strip, rest.split("[TOOL_CALLS]")):
                match = _MISTRAL_ARGS.match(part)
                if match is None:
                    return ParsedOutput(_content(text), ())
                args, _ = decoder.raw_decode(part, match.end())
                call = _call({"name": match.group(1), "arguments": args})
                if call is None:
                    return ParsedOutput(_content(text), ())
                calls.append(call)
    except json.JSONDecodeError:
        return ParsedOutput(_content(text), ())
    return ParsedOutput(_content(text[:start]), tuple(calls))


def required_calls(text: str) -> list[ToolCall] | None:
    """The calls of our forced-call format, or None when ``text`` is not one."""
    objs = _loads(text)
    calls = [_call(o, ("parameters",)) for o in objs] if isinstance(objs, list) else [None]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def parse_required(text: str) -> ParsedOutput:
    """Our forced-call format: ``[{"name": ..., "parameters": {...}}, ...]``."""
    calls = required_calls(text)
    return ParsedOutput(_content(text), ()) if calls is None else ParsedOutput(None, tuple(calls))


def parse_named(text: str, name: str) -> ParsedOutput:
    """Our named-call format: the arguments object alone."""
    call = _call({"name": name, "arguments": text})
    # The arguments stay exactly as generated (they are what a stream of this call sends).
    return ParsedOutput(_content(text), ()) if call is None else ParsedOutput(None, (ToolCall(name, text),))


_PARSERS: dict[str, Callable[[str], ParsedOutput]] = {
    "hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral, "required": parse_required,
    "pythonic": parse_pythonic,
}


def _parse_harmony(text: str) -> ParsedOutput:
    """Harmony's calls and its content channels (its reasoning is dropped here: ``chat_output``
    splits it off first)."""
    out = parse_harmony(text, with_tools=True)
    return ParsedOutput(out.content if out.content.strip() else None, out.tool_calls)


def parse_tool_calls(mode: str, text: str, name: str | None = None, tools: Tools = ()) -> ParsedOutput:
    """``mode``: a family, ``required`` or ``named`` (with the forced function's ``name``);
    ``tools``: the request's tools (their schemas type the values of qwen3_coder and glm45)."""
    if mode == "named":
        if name is None:
            raise ValueError("the named mode needs the function name")
        return parse_named(text, name)
    fmt = BLOCK_FORMATS.get(mode)
    parser = _PARSERS.get(mode) or (_parse_harmony if mode == "harmony" else None)
    if parser is None and fmt is None:
        known = ", ".join([*_PARSERS, *BLOCK_FORMATS, "harmony"])
        raise ValueError(f"unknown tool-call format {mode!r}; one of {known}, named")
    try:
        return parse_blocks(fmt, text, tools) if fmt is not None else parser(text)  # type: ignore[misc]
    except MemoryError:  # output too large to parse as calls in the memory left: it stays text
        return ParsedOutput(_content(text), ())

