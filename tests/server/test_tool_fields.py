"""The tool fields of a chat request (``tools``, ``tool_choice``, ``parallel_tool_calls`` and a
history's ``tool_calls``) read with ``fields``' readers: each refusal is a 400 naming the
top-level field, with the path and the same wording as every other field's error. No engine."""

from __future__ import annotations

import pytest

from inflight.runtime.server.errors import APIError
from inflight.runtime.server.openai.protocol import parse_chat_request

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _refusal(body: dict) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat_request({"messages": MSG, **body})
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"tools": {"a": 1}}, "tools", "'tools' must be a list (got {'a': 1})"),
    ({"tools": [TOOL] * 129}, "tools", "'tools' may hold at most 128 entries (got 129)"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "'tools[0]' must be {'type': 'function', 'function': {...}}"),
    ({"tools": [{"type": "function", "function": 3}]}, "tools", "'tools[0].function' must be an object (got 3)"),
    ({"tools": [{"function": {"name": 7}}]}, "tools", "'tools[0].function.name' must be a string (got 7)"),
    ({"tools": [{"function": {"name": ""}}]}, "tools", "'tools[0].function.name' must be a non-empty string"),
    ({"tools": [TOOL, {"function": {"name": "f", "parameters": []}}]}, "tools",
     "'tools[1].function.parameters' must be an object (got [])"),
    ({"tools": [TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls",
     "'parallel_tool_calls' must be true or false (got 'no')"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs 'tools'"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": 3}}}, "tool_choice",
     "'tool_choice.function.name' must be a string (got 3)"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice",
     "'tool_choice' must be none, auto, required or {'type': 'function', 'function': {'name': ...}}"),
])
def test_tool_field_refusals_name_the_field_as_other_fields_do(body: dict, param: str, message: str) -> None:
    error = _refusal(body)
    assert (error.param, error.message) == (param, message)


def test_the_shared_readers_word_a_tool_field_as_a_sampling_field() -> None:
    """One wording: a wrong boolean reads the same for a tool field and for ``stream``."""
    tool = _refusal({"tools": [TOOL], "parallel_tool_calls": 1}).message
    stream = _refusal({"stream": 1}).message
    assert tool.replace("parallel_tool_calls", "X") == stream.replace("stream", "X")


@pytest.mark.parametrize(("history", "message"), [
    ({"tool_calls": "x"}, "'messages[1].tool_calls' must be a list (got 'x')"),
    ({"tool_calls": [{"function": 5}]}, "'messages[1].tool_calls[0].function' must be an object (got 5)"),
    ({"tool_calls": [{"function": {"name": 5}}]}, "'messages[1].tool_calls[0].function.name' must be a string (got 5)"),
    ({"tool_calls": [{}]}, "'messages[1].tool_calls[0]' needs function.name and function.arguments"),
    ({"tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "'messages[1].tool_calls[0].function.arguments' must be a JSON object (got [1])"),
    ({"tool_calls": [{"id": 3, "function": {"name": "f"}}]}, "'messages[1].tool_calls[0].id' must be a string (got 3)"),
    ({"name": 4}, "'messages[1].name' must be a string (got 4)"),
])
def test_history_tool_fields_name_messages(history: dict, message: str) -> None:
    with pytest.raises(APIError) as info:
        parse_chat_request({"messages": [*MSG, {"role": "assistant", "content": "", **history}]})
    assert (info.value.param, info.value.message) == ("messages", message)


def test_tool_fields_reach_the_request() -> None:
    history = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    req = parse_chat_request({"messages": [*MSG, history, {"role": "tool", "tool_call_id": "c1", "content": "9C"}],
                              "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                              "parallel_tool_calls": False})
    features = req.features
    assert (features.tool_choice, features.tool_name, features.parallel_tool_calls) == ("named", "get_weather", False)
    assert req.messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}, "id": "c1"}]
    assert req.messages[2]["tool_call_id"] == "c1"
    assert parse_chat_request({"messages": MSG, "tools": [TOOL]}).features.parallel_tool_calls is True
