"""Translate an Anthropic Messages request into an OpenAI chat completion body.

Owns which Messages fields are served and how: ``system`` (a string or text blocks),
``messages`` with ``text``, ``tool_use``, ``tool_result`` and ``thinking`` blocks, ``tools``
(``input_schema``), ``tool_choice`` (auto / any / tool / none, ``disable_parallel_tool_use``),
``max_tokens`` (required, as Anthropic's API), ``stop_sequences``, ``temperature`` / ``top_p`` /
``top_k`` (older clients and raw HTTP send them), ``metadata.user_id``, ``output_config.format``
(structured outputs), ``stream``. A field left out is left out of the chat body too,
so the model's own generation defaults apply (Anthropic's 2.x client sends no temperature).
What is not served (images, documents, server tools, ``thinking``...) is a 400 naming it, never
ignored; a field the API does not have follows the server's policy (``known_fields``: named in a
header and logged, or a 400 with ``--reject-unknown-fields``). Knows nothing about HTTP or the
engine.
"""

from __future__ import annotations

import json
from typing import Any

from inflight.runtime.sampling_params import brief
from inflight.runtime.server.errors import bad_request
from inflight.runtime.server.openai.known_fields import check_known

PASSED = ("model", "temperature", "top_p", "top_k", "stream")
# Accepted and without effect on what the model writes: service_tier, inference_geo, workspace_id,
# user_profile_id, and cache_control (the prefix cache reuses a repeated prompt by itself).
KNOWN = (*PASSED, "max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "metadata",
         "thinking", "output_config", "service_tier", "container", "mcp_servers", "context_management",
         "cache_control", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id")
OFF_VALUES: dict[str, tuple[object, ...]] = {
    "container": (None,), "mcp_servers": (None, []), "context_management": (None,), "diagnostics": (None,),
    "speed": (None, "standard"),
}


def translate(body: object, reject_unknown: bool = False) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The chat body for a Messages request ``body``, and the fields the API does not have
    (the server's policy: named in a header and logged; ``reject_unknown``: a 400 instead)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    ignored = check_known(body, KNOWN, reject=reject_unknown)
    for name, off in OFF_VALUES.items():
        if body.get(name) not in off:
            raise bad_request(f"'{name}' is not supported by this server; leave it out", name)
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") != "disabled"):
        raise bad_request("'thinking' is not supported by this server (a reasoning model's thinking comes back as "
                          "thinking blocks as its chat template says); leave it out", "thinking")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad_request(f"max_tokens: a whole number >= 1 is required (got {brief(max_tokens)})", "max_tokens")
    chat: dict[str, Any] = {name: body[name] for name in PASSED if body.get(name) is not None}
    chat["max_tokens"] = max_tokens
    chat["messages"] = _system(body.get("system")) + messages(body.get("messages"))
    if body.get("stop_sequences") is not None:
        stops = body["stop_sequences"]
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise bad_request("stop_sequences must be a list of non-empty strings", "stop_sequences")
        chat["stop"] = stops
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad_request("metadata must be an object", "metadata")
        if isinstance(metadata.get("user_id"), str):
            chat["user"] = metadata["user_id"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        chat.update(_tool_choice(choice))
    response_format = _output_format(body.get("output_config"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat, ignored


def _output_format(config: object) -> dict[str, Any] | None:
    """``output_config.format`` (a JSON schema the answer must match) as structured outputs."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad_request("output_config must be an object", "output_config")
    if config.get("effort") is not None:
        raise bad_request("output_config.effort is not supported by this server; leave it out", "output_config")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request("output_config.format must be {'type': 'json_schema', 'schema': {...}}", "output_config")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _system(system: object) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": _text_blocks(system, "system")}]


def _text_blocks(blocks: object, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    parts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad_request(f"{where}: only text blocks are supported here (got {brief(kind)})", where)
        parts.append(block["text"])
    return "".join(parts)


def messages(value: object) -> list[dict[str, Any]]:
    """Chat messages for Anthropic ``messages``: a user turn's ``tool_result`` blocks become tool
    messages (in order, before its text), an assistant turn's ``tool_use`` blocks its tool calls."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages: a non-empty list of {role, content} is required", "messages")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"messages.{i}.role must be user or assistant (got {brief(role)})", "messages")
        content = message.get("content")  # type: ignore[union-attr]
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"messages.{i}.content must be a string or a list of content blocks", "messages")
        out += _blocks(role, content, i, names)
    return out


def _blocks(role: str, blocks: list[Any], index: int, names: dict[str, str]) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thinking: list[str] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"messages.{index}.content"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input", {}), dict):
                raise bad_request(f"{where}: a tool_use block needs a string id and name and an object input",
                                  "messages")
            names[block["id"]] = block["name"]
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise bad_request(f"{where}: a tool_result block needs a string tool_use_id", "messages")
            text = _text_blocks(block.get("content", ""), "messages")
            if block.get("is_error") is True:
                text = f"Error: {text}"
            result = {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}
            if block["tool_use_id"] in names:
                result["name"] = names[block["tool_use_id"]]
            results.append(result)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        else:
            raise bad_request(f"{where}: {brief(kind)} blocks are not supported in a {role} message; this server "
                              "takes text, tool_use (assistant), tool_result (user) and thinking (assistant)",
                              "messages")
    out = list(results)
    if texts or calls or thinking or not results:
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        out.append(message)
    return out


def _tools(tools: object) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {name, description, input_schema}", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools.{i}: the server tool {brief(kind)} is not served here; offer custom tools "
                              "with an input_schema", "tools")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise bad_request(f"tools.{i} needs a string name and an input_schema object", "tools")
        fn = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: object) -> dict[str, Any]:
    kind = choice.get("type") if isinstance(choice, dict) else None
    out: dict[str, Any] = {}
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool" and isinstance(choice.get("name"), str):  # type: ignore[union-attr]
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}  # type: ignore[index]
    else:
        raise bad_request(f"tool_choice must be {{'type': auto | any | tool | none}} (got {brief(choice)})",
                          "tool_choice")
    if choice.get("disable_parallel_tool_use") is True:  # type: ignore[union-attr]
        out["parallel_tool_calls"] = False
    return out
