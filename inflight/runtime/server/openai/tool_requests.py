"""The tools a chat request offers and the tool calls its history carries.

Owns ``tools`` (at most ``MAX_TOOLS`` function tools with JSON-schema parameters),
``tool_choice`` and ``parallel_tool_calls``, the schema a forced call (``required`` or a named
function) must match, with every object closed so the arguments parse and validate, and the
history's assistant ``tool_calls`` / tool results as the chat template wants them. Fields are
read with ``fields``' readers, so their 400s name the field (``tools``, ``tool_choice``,
``parallel_tool_calls``, ``messages``) and read as every other field's. Knows nothing about
tokenizers or the engine.
"""

from __future__ import annotations

import json
from typing import Any

from inflight.runtime.json_text import loads_limited
from inflight.runtime.sampling_params import brief
from inflight.runtime.server.errors import bad_request
from inflight.runtime.server.openai.fields import get_bool, get_list, get_object, get_str

MAX_TOOLS = 128


def parse_tools(obj: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...], str, str | None, bool]:
    """``tools``, ``tool_choice`` (none, auto, required or named) with the named function, and
    ``parallel_tool_calls`` (true unless sent false)."""
    tools = get_list(obj, "tools", MAX_TOOLS) or []
    names = [_tool_name(tool, i) for i, tool in enumerate(tools)]
    parallel = get_bool(obj, "parallel_tool_calls")
    choice, name = _parse_tool_choice(obj.get("tool_choice"), names)
    return tuple(tools), choice, name, parallel is not False


def _tool_name(tool: object, index: int) -> str:
    """The name of ``tools[index]``, a function tool whose parameters (if given) are an object."""
    at = f"tools[{index}]"
    fn = get_object(tool, "function", "tools", f"{at}.function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or fn is None:
        raise bad_request(f"'{at}' must be {{'type': 'function', 'function': {{...}}}}", "tools")
    name = get_str(fn, "name", "tools", f"{at}.function.name")
    if not name:
        raise bad_request(f"'{at}.function.name' must be a non-empty string", "tools")
    get_object(fn, "parameters", "tools", f"{at}.function.parameters")
    return name


def _parse_tool_choice(value: object, names: list[str]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if value in ("none", "auto", "required"):
        if value != "none" and not names:
            raise bad_request(f"tool_choice '{value}' needs 'tools'", "tool_choice")
        return str(value), None
    fn = get_object(value, "function", "tool_choice", "tool_choice.function") if isinstance(value, dict) else None
    name = get_str(fn, "name", "tool_choice", "tool_choice.function.name") if fn is not None else None
    if name is None or value.get("type") != "function":  # type: ignore[union-attr]
        raise bad_request("'tool_choice' must be none, auto, required or "
                          "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names '{name}', which is not in 'tools'", "tool_choice")
    return "named", name


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
    at = f"messages[{index}]"
    message: dict[str, Any] = {"role": raw["role"], "content": content}
    calls = get_list(raw, "tool_calls", param="messages", at=f"{at}.tool_calls")
    if calls is not None and raw["role"] == "assistant":
        message["tool_calls"] = [_history_call(c, f"{at}.tool_calls[{i}]") for i, c in enumerate(calls)]
    for key in ("tool_call_id", "name", "reasoning_content"):
        value = get_str(raw, key, "messages", f"{at}.{key}")
        if value is not None:
            message[key] = value
    return message


def _history_call(call: object, at: str) -> dict[str, Any]:
    """One call of an assistant's ``tool_calls`` (``at``: its path), arguments as an object."""
    fn = get_object(call, "function", "messages", f"{at}.function") if isinstance(call, dict) else None
    name = get_str(fn, "name", "messages", f"{at}.function.name") if fn is not None else None
    if fn is None or name is None:
        raise bad_request(f"'{at}' needs function.name and function.arguments", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = loads_limited(args) if args.strip() else {}
        except ValueError as exc:
            raise bad_request(f"'{at}.function.arguments' must be a JSON object ({str(exc)[:120]})",
                              "messages") from None
    if not isinstance(args, dict):
        raise bad_request(f"'{at}.function.arguments' must be a JSON object (got {brief(args)})", "messages")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    call_id = get_str(call, "id", "messages", f"{at}.id")  # type: ignore[arg-type]
    if call_id is not None:
        out["id"] = call_id
    return out
