"""A ``MemoryError`` while parsing what a client sent is the client's error: a 413 (the body,
the request as a whole) or a 400 naming the field (JSON inside a string), in the OpenAI error
shape, never a 500; model output too large to parse as tool calls stays text. The
``MemoryError`` is injected (the parser patched to raise it), not provoked by exhausting memory."""

from __future__ import annotations

import json
import types
from typing import Any

import pytest

from inflight.runtime import json_text
from inflight.runtime.server.openai import api as openai_api
from inflight.runtime.server.openai import tool_calls
from tests.server.server_helpers import MODEL_NAME, LiveServer, http

C = "/v1/completions"
CHAT = "/v1/chat/completions"
CHAT_BODY = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _out_of_memory(*args: Any, **kwargs: Any) -> Any:
    raise MemoryError


def _json_without_memory() -> types.SimpleNamespace:
    """The ``json`` module as a patched module sees it: ``loads`` raises ``MemoryError``."""
    return types.SimpleNamespace(loads=_out_of_memory, JSONDecodeError=json.JSONDecodeError, dumps=json.dumps)


def _client_error(reply: Any, status: int, param: str | None) -> dict[str, Any]:
    assert reply.status == status, reply.text[:300]
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error


@pytest.mark.parametrize("path", [C, CHAT, "/tokenize"])
def test_a_body_too_large_to_parse_is_413(server: LiveServer, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setattr(openai_api, "json", _json_without_memory())
    error = _client_error(http("POST", server.url + path, CHAT_BODY), 413, None)
    assert error["code"] == "request_too_large" and "memory" in error["message"]
    monkeypatch.undo()
    assert http("POST", server.url + path, CHAT_BODY).status in (200, 400)  # the server goes on
    assert http("GET", server.url + "/health").status == 200


SCHEMA = '{"type": "object"}'
JSON_IN_STRINGS = [
    ("guided_json", C, {"prompt": "x", "guided_json": SCHEMA}, "guided_json"),
    ("structured_outputs.json", C, {"prompt": "x", "structured_outputs": {"json": SCHEMA}}, "structured_outputs"),
    ("history tool-call arguments", CHAT, {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                               "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in JSON_IN_STRINGS],
                         ids=[c[0] for c in JSON_IN_STRINGS])  # fmt: skip
def test_json_in_a_string_too_large_to_parse_is_400_naming_the_field(
        server: LiveServer, monkeypatch: pytest.MonkeyPatch, path: str, body: dict, param: str) -> None:
    monkeypatch.setattr(json_text, "json", _json_without_memory())
    error = _client_error(http("POST", server.url + path, {"model": MODEL_NAME, "max_tokens": 2, **body}), 400, param)
    assert "memory" in error["message"]


@pytest.mark.parametrize("path", [C, CHAT])
def test_a_request_too_large_to_parse_or_plan_is_413(server: LiveServer, monkeypatch: pytest.MonkeyPatch,
                                                     path: str) -> None:
    name = "parse_chat_request" if path == CHAT else "parse_completion_request"
    monkeypatch.setattr(openai_api, name, _out_of_memory)
    body = CHAT_BODY if path == CHAT else {"model": MODEL_NAME, "max_tokens": 2, "prompt": "hi"}
    error = _client_error(http("POST", server.url + path, body), 413, None)
    assert error["code"] == "request_too_large"
    monkeypatch.undo()
    monkeypatch.setattr(openai_api.generation, "plan", _out_of_memory)
    _client_error(http("POST", server.url + path, body), 413, None)


def test_model_output_too_large_to_parse_stays_text(monkeypatch: pytest.MonkeyPatch) -> None:
    text = 'hi <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert tool_calls.parse_tool_calls("hermes", text).tool_calls  # a call, normally
    monkeypatch.setattr(json_text, "json", _json_without_memory())
    assert tool_calls.parse_tool_calls("hermes", text) == tool_calls.ParsedOutput(text, ())
    monkeypatch.setitem(tool_calls._PARSERS, "mistral", _out_of_memory)
    assert tool_calls.parse_tool_calls("mistral", "[TOOL_CALLS]x") == tool_calls.ParsedOutput("[TOOL_CALLS]x", ())
