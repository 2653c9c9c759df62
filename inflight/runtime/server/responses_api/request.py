"""Translate a Responses API request into an OpenAI chat completion body.

Owns which Responses fields are served and how: ``input`` (a string, or items: messages with
text parts, ``function_call``, ``function_call_output`` and ``reasoning`` items),
``instructions``, ``max_output_tokens``, the sampling fields, function ``tools`` (the flattened
shape) and ``tool_choice``, ``text.format`` (structured outputs), ``stream``. Every field the
server does not implement (built-in tools, ``background``, ``conversation``, ``include``,
``truncation: auto``, images and files...) is a 400 naming it, never ignored. The chat body then
goes through ``parse_chat_request``, so every check of /v1/chat/completions applies. A field
the API does not have is handled by the server's policy (``known_fields``: named in a header
and logged, or a 400 with ``--reject-unknown-fields``). Knows
nothing about HTTP, the engine or the store (the caller hands over a previous conversation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inflight.runtime.sampling_params import brief
from inflight.runtime.server.errors import bad_request
from inflight.runtime.server.openai.known_fields import check_known

# Fields passed to the chat body unchanged (vLLM accepts its sampling extras here too).
PASSED = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "top_k", "min_p",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "priority",
          "cache_salt", "min_tokens")
# Bookkeeping fields that change nothing the model writes: accepted, echoed where the
# Response object has them.
ACCEPTED = ("metadata", "service_tier", "prompt_cache_key", "safety_identifier", "stream_options",
            "store", "previous_response_id", "instructions", "input", "max_output_tokens", "tools",
            "tool_choice", "text", "reasoning", "stream", "include", "truncation", "background",
            "conversation", "top_logprobs", "max_tool_calls", "prompt", "prompt_cache_retention")
# Fields refused unless they hold one of these "off" values.
OFF_VALUES: dict[str, tuple[object, ...]] = {
    "background": (None, False),
    "conversation": (None,),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "top_logprobs": (None, 0),
    "max_tool_calls": (None,),
    "prompt": (None,),
    "prompt_cache_retention": (None,),
}
KNOWN = frozenset((*PASSED, *ACCEPTED))
BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview", "computer",
                  "code_interpreter", "image_generation", "mcp", "local_shell", "shell", "custom",
                  "apply_patch")


@dataclass(frozen=True, slots=True)
class Translated:
    """A Responses request as a chat body, with what the response echoes back and the
    conversation's items (``items``: the previous conversation and this input, for the store)."""

    chat_body: dict[str, Any]
    items: list[dict[str, Any]]
    echo: dict[str, Any]
    stream: bool
    store: bool
    ignored: tuple[str, ...] = ()


def translate(body: object, previous_items: list[dict[str, Any]] | None, store_enabled: bool,
              reject_unknown: bool = False) -> Translated:
    """The chat body for a Responses request ``body``; ``previous_items``: the conversation of
    ``previous_response_id`` (its input and output items), when it names one. A field the API
    does not have is named in ``ignored`` (the server's policy: ``reject_unknown`` makes it
    OpenAI's 400 instead)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    ignored = check_known(body, KNOWN, reject=reject_unknown)
    for name, off in OFF_VALUES.items():
        if body.get(name) is not None and body[name] not in off:
            raise bad_request(f"'{name}' {brief(body[name])} is not supported by this server; leave it out", name)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad_request("'store' must be true or false", "store")
    if store is True and not store_enabled:
        raise bad_request("this server keeps no responses ('store': true); start it with --enable-responses-store, "
                          "or send 'store': false", "store")
    items = list(previous_items or []) + input_items(body.get("input"))
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    messages += items_to_messages(items)
    chat: dict[str, Any] = {name: body[name] for name in PASSED if body.get(name) is not None}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools:
        chat["tools"] = _tools(tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    _check_reasoning(body.get("reasoning"))
    stream = body.get("stream")
    if stream is not None:
        if not isinstance(stream, bool):
            raise bad_request("'stream' must be true or false", "stream")
        chat["stream"] = stream
    echo = {
        "instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"), "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "tool_choice": body.get("tool_choice") or "auto", "tools": tools or [],
        "text": body.get("text") or {"format": {"type": "text"}}, "user": body.get("user"),
        "truncation": "disabled", "reasoning": body.get("reasoning"),
    }
    return Translated(chat, items, echo, bool(stream), store_enabled and store is not False, ignored)


def input_items(value: object) -> list[dict[str, Any]]:
    """``input`` as a list of items (a string is one user message)."""
    if value is None:
        raise bad_request("'input' is required: a string or a list of input items", "input")
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", "input")
    return list(value)


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for Responses items: messages, function calls (grouped into the assistant
    message they follow), their outputs (tool messages) and reasoning (the next assistant
    message's ``reasoning_content``)."""
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the tool messages
    reasoning: list[str] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            message = {"role": _role(item, i), "content": _text(item.get("content"), i)}
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"] = "".join(reasoning)
                reasoning = []
            messages.append(message)
        elif kind == "function_call":
            call = _call(item, i)
            names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or (last.get("tool_calls") is None and reasoning):
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            if reasoning:
                last["reasoning_content"] = "".join(reasoning)
                reasoning = []
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", i)
            message = {"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"), i, "output")}
            if call_id in names:
                message["name"] = names[call_id]
            messages.append(message)
        elif kind == "reasoning":
            reasoning += [part.get("text", "") for part in (item.get("content") or []) + (item.get("summary") or [])
                          if isinstance(part, dict) and isinstance(part.get("text"), str)]
        else:
            raise bad_request(f"input[{i}].type {brief(kind)} is not supported: send message, function_call, "
                              "function_call_output or reasoning items", "input")
    return messages


def _role(item: dict[str, Any], index: int) -> str:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_request(f"input[{index}].role must be user, system, developer or assistant (got {brief(role)})",
                          "input")
    return str(role)


def _text(content: object, index: int, field: str = "content") -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{index}].{field} must be a string or a list of text parts", "input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):  # type: ignore[union-attr]
            raise bad_request(f"input[{index}].{field} parts must be input_text or output_text parts "
                              f"(got {brief(kind)}): this server takes text only", "input")
        parts.append(part["text"])  # type: ignore[index]
    return "".join(parts)


def _string(item: dict[str, Any], name: str, index: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"input[{index}].{name} must be a non-empty string", "input")
    return value


def _call(item: dict[str, Any], index: int) -> dict[str, Any]:
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise bad_request(f"input[{index}].arguments must be a string of JSON", "input")
    return {"id": _string(item, "call_id", index), "type": "function",
            "function": {"name": _string(item, "name", index), "arguments": arguments}}


def _tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in BUILT_IN_TOOLS:
            raise bad_request(f"tools[{i}]: the built-in tool {kind!r} is not served here; offer function tools",
                              "tools")
        if kind != "function" or not isinstance(tool.get("name"), str):  # type: ignore[union-attr]
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'name': ..., 'parameters': {{...}}}}",
                              "tools")
        fn = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}  # type: ignore[union-attr]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: object) -> object:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("'tool_choice' must be none, auto, required or {'type': 'function', 'name': ...} "
                      f"(got {brief(choice)})", "tool_choice")


def _text_format(text: object) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object such as {'format': {'type': 'text'}}", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("'text.verbosity' is not supported by this server; leave it out", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {key: fmt[key] for key in ("name", "schema", "strict") if fmt.get(key) is not None}  # type: ignore[union-attr]
        if not isinstance(spec.get("schema"), dict):
            raise bad_request("'text.format.schema' must be a JSON schema object", "text.format")
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(f"'text.format.type' must be text, json_object or json_schema (got {brief(kind)})", "text.format")


def _check_reasoning(reasoning: object) -> None:
    if reasoning is None:
        return
    if not isinstance(reasoning, dict):
        raise bad_request("'reasoning' must be an object", "reasoning")
    for key in ("effort", "summary", "generate_summary"):
        if reasoning.get(key) is not None:
            raise bad_request(f"'reasoning.{key}' is not supported by this server (the model reasons as its chat "
                              "template says; its reasoning comes back as reasoning items); leave it out",
                              f"reasoning.{key}")
