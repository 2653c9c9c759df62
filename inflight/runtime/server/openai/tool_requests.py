"""The tools a chat request offers and the tool calls its history carries.

Owns ``tools`` (at most ``MAX_TOOLS`` function tools with JSON-schema parameters),
``tool_choice`` and ``parallel_tool_calls``, the schema a forced call (``required`` or a named
function) must match, with every object closed so the arguments parse and validate, and the
history's assistant ``tool_calls`` / tool results as the chat template wants them. Errors are
400s naming the field. Knows nothing about tokenizers or the engine.
"""

from __future__ import annotations

import json
from typing import Any

from inflight.runtime.json_text import loads_limited
from inflight.runtime.server.errors import bad_request

MAX_TOOLS = 128


def parse_tools(obj: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], str, str | None, bool]:
    tools = obj.get("tools") or []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} function tools", "tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", "tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(fn["name"])
    parallel = obj.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    choice, name = _parse_tool_choice(obj.get("tool_choice"), names)
    return tuple(tools), choice, name, parallel


def _parse_tool_choice(value: object, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not names:
            raise bad_request(f"tool_choice '{value}' needs 'tools'", "tool_choice")
        return str(value), None
    fn = value.get("function") if isinstance(value, dict) else None
    if not isinstance(fn, dict) or value.get("type") != "function" or not isinstance(fn.get("name"), str):  # type: ignore[union-attr]
        raise bad_request("'tool_choice' must be none, auto, required or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if fn["name"] not in names:
        raise bad_request(f"tool_choice names '{fn['name']}', which is not in 'tools'", "tool_choice")
    return "named", fn["name"]


def _params_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A forced call's arguments schema, closed: an object that lists its ``properties`` and says
    nothing of ``additionalProperties`` gets ``false``, as OpenAI's strict function calling and
    vLLM's default (xgrammar) grammar engine treat it. Left open, a weak model keeps inventing
    keys (SmolLM2 was seen adding ``unit_map``, ``unit_map_type``, ... until ``max_tokens``)."""
    return _closed(tool["function"].get("parameters") or {"type": "object", "properties": {}})


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "prefixItems", "additionalItems", "additionalProperties", "contains",
               "anyOf", "oneOf", "not", "if", "then", "else", "propertyNames")


def _closed(schema: Any) -> Any:
    """A copy of ``schema`` with undeclared object properties refused (see ``_params_schema``).

    ``allOf`` branches are left as written: closing each branch would refuse the properties
    the other branches declare."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = _closed(out[key])
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
    if isinstance(out.get("properties"), dict) and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def forced_tool_schema(
    tools: tuple[dict[str, Any], ...], choice: str, name: str | None, parallel: bool
) -> dict[str, Any]:
    """The JSON schema a forced tool call (``required``, or a ``named`` function) must match:
    the named function's parameters, or a list of calls of the offered functions."""
    if choice == "named":
        return _params_schema(next(t for t in tools if t["function"]["name"] == name))
    items = [
        {"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": _params_schema(t)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return json.loads(json.dumps(schema))


def chat_message(raw: dict[str, Any], index: int, content: str) -> dict[str, Any]:
    """A chat message for the template: role and text, plus the tool fields a history carries
    (an assistant's ``tool_calls`` with arguments as objects, a tool result's ``tool_call_id``
    and ``name``, an assistant's ``reasoning_content``)."""
    message: dict[str, Any] = {"role": raw["role"], "content": content}
    calls = raw.get("tool_calls")
    if calls is not None and raw["role"] == "assistant":
        if not isinstance(calls, list):
            raise bad_request(f"messages[{index}].tool_calls must be a list", "messages")
        message["tool_calls"] = [_history_call(c, index) for c in calls]
    for key in ("tool_call_id", "name", "reasoning_content"):
        if raw.get(key) is not None:
            if not isinstance(raw[key], str):
                raise bad_request(f"messages[{index}].{key} must be a string", "messages")
            message[key] = raw[key]
    return message


def _history_call(call: object, index: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"messages[{index}].tool_calls entries need function.name and function.arguments",
                          "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = loads_limited(args) if args.strip() else {}
        except ValueError as exc:
            raise bad_request(f"messages[{index}].tool_calls arguments must be a JSON object ({str(exc)[:120]})",
                              "messages") from None
    if not isinstance(args, dict):
        raise bad_request(f"messages[{index}].tool_calls arguments must be a JSON object", "messages")
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call, dict) and isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
