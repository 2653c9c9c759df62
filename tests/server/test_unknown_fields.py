"""No request field ignored in silence: unknown top-level and nested fields are named in
``ignored_fields`` and the ``x-inflight-ignored-fields`` header (streamed answers too) and logged
once per name, or refused with OpenAI's own 400 under ``--reject-unknown-fields``, the near miss
suggested."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.errors import APIError
from inflight.runtime.server.openai.known_fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    IGNORED_FIELDS,
    IGNORED_FIELDS_HEADER,
    MAX_HEADER_NAMES,
    MAX_NAME_CHARS,
    IgnoredFieldLog,
    check_known,
    header_value,
    record_ignored,
)
from inflight.runtime.server.openai.protocol import RequestPolicy, parse_chat_request, parse_completion_request
from tests.server.server_helpers import MODEL_NAME, LiveServer, http

MSG = [{"role": "user", "content": "hi"}]
STRICT = RequestPolicy(reject_unknown_fields=True)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def _refusal(parse, body: dict) -> APIError:  # noqa: ANN001
    with pytest.raises(APIError) as info:
        parse(body, STRICT)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


def test_misspelled_top_level_fields_are_named() -> None:
    assert parse_completion_request({"prompt": "x", "max_token": 3}).ignored_fields == ("max_token",)
    req = parse_chat_request({"messages": MSG, "temprature": 0, "max_tokens": 2})
    assert req.ignored_fields == ("temprature",) and req.params.max_tokens == 2


def test_known_fields_are_not_named() -> None:
    body = {"model": "m", "messages": MSG, "temperature": 0.5, "top_p": 0.9, "max_completion_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
            "user": "u", "metadata": {"a": "b"}, "store": False, "seed": 3, "stop": ["x"], "n": 1,
            "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": True, "skip_special_tokens": True, "cache_salt": "s"}
    assert parse_chat_request(body).ignored_fields == ()
    schema = {"type": "json_schema", "json_schema": {"name": "s", "strict": True, "schema": {"type": "object"}}}
    assert parse_chat_request({"messages": MSG, "response_format": schema}).ignored_fields == ()
    assert parse_completion_request({"prompt": "x", "logprobs": 1, "echo": True, "best_of": 2,
                                     "n": 1, "top_k": 3}).ignored_fields == ()


def test_endpoint_specific_fields() -> None:
    """Each endpoint's own fields are unknown to the other when the other would ignore them."""
    assert parse_completion_request({"prompt": "x", "messages": MSG, "max_completion_tokens": 3}).ignored_fields == (
        "messages", "max_completion_tokens")
    assert parse_chat_request({"messages": MSG, "prompt": "x"}).ignored_fields == ("prompt",)
    with pytest.raises(APIError) as info:  # a chat-only field that completions refuses keeps its own message
        parse_completion_request({"prompt": "x", "tools": [TOOL]}, STRICT)
    assert info.value.param == "tools" and "only for /v1/chat/completions" in info.value.message


def test_nested_misspellings_are_named() -> None:
    tool = {"type": "function", "function": {"name": "f", "paramters": {}}}
    body = {"messages": MSG, "stream": True, "stream_options": {"include_usge": True}, "tools": [TOOL, tool],
            "tool_choice": {"type": "function", "function": {"name": "f", "argument": 1}}}
    assert parse_chat_request(body).ignored_fields == (
        "stream_options.include_usge", "tools[1].function.paramters", "tool_choice.function.argument")
    rf = {"type": "json_object", "schema": {"type": "object"}}  # another vendor's spelling: the schema is ignored
    assert parse_chat_request({"messages": MSG, "response_format": rf}).ignored_fields == ("response_format.schema",)
    rf = {"type": "json_schema", "json_schema": {"name": "s", "shema": {}}}
    assert parse_chat_request({"messages": MSG, "response_format": rf}).ignored_fields == (
        "response_format.json_schema.shema",)


def test_message_misspellings_are_named_and_replayed_replies_are_not() -> None:
    """A misspelt message key (``contnet``) would send an empty message; an assistant message
    replayed as the openai client returned it (every field, most null) is all known."""
    replayed = {"role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
                "function_call": None, "reasoning_content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    body = {"messages": [{"role": "user", "contnet": "hi"}, replayed,
                         {"role": "tool", "tool_call_id": "c1", "content": "1", "tool_cal_id": "c1"}]}
    assert parse_chat_request(body).ignored_fields == ("messages[0].contnet", "messages[2].tool_cal_id")
    bad_call = {**replayed, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "args": "{}"}}]}
    assert parse_chat_request({"messages": [*MSG, bad_call]}).ignored_fields == (
        "messages[1].tool_calls[0].function.args",)


def test_reject_answers_openais_400_with_the_near_miss() -> None:
    error = _refusal(parse_completion_request, {"prompt": "x", "max_token": 3})
    assert error.message == "Unrecognized request argument supplied: max_token (did you mean 'max_tokens'?)"
    assert error.param == "max_token"
    error = _refusal(parse_chat_request, {"messages": MSG, "temprature": 0, "zzz": 1})
    assert error.message == ("Unrecognized request arguments supplied: temprature (did you mean 'temperature'?), "
                             "zzz")
    assert error.param == "temprature"
    error = _refusal(parse_chat_request, {"messages": MSG, "stream": True, "stream_options": {"include_usge": True}})
    assert error.param == "stream_options.include_usge" and "did you mean 'include_usage'?" in error.message
    assert parse_chat_request({"messages": MSG, "temperature": 0}, STRICT).ignored_fields == ()


def test_check_known_for_other_endpoints() -> None:
    """The function other APIs call with their own known set."""
    assert check_known({"input": "x", "max_output_token": 3}, {"input", "max_output_tokens"}, reject=False) == (
        "max_output_token",)
    with pytest.raises(APIError) as info:
        check_known({"input": "x", "max_output_token": 3}, {"input", "max_output_tokens"}, reject=True)
    assert "did you mean 'max_output_tokens'?" in info.value.message
    assert "max_tokens" in COMPLETION_FIELDS and "messages" in CHAT_FIELDS


def test_record_ignored_adds_to_what_is_there() -> None:
    """An API that translates its body into a chat body records its names; the chat parser's join them."""
    from aiohttp.test_utils import make_mocked_request

    request = make_mocked_request("POST", "/v1/responses")
    record_ignored(request, ())
    assert IGNORED_FIELDS not in request
    record_ignored(request, ("max_output_token",))
    record_ignored(request, ("temprature", "max_output_token"))
    assert request[IGNORED_FIELDS] == ("max_output_token", "temprature")


def test_header_value_is_safe_and_bounded() -> None:
    value = header_value(("a\r\nSet-Cookie: x", "é", *(f"f{i}" for i in range(40))))
    assert value.isascii() and "\r" not in value and "\n" not in value
    assert value.startswith("a%0D%0ASet-Cookie:%20x, %C3%A9, f0") and value.endswith(f"(+{42 - MAX_HEADER_NAMES} more)")
    assert len(header_value(("x" * 10_000,))) < 100
    worst = header_value(tuple(f"{i}" + "\U0001fbf8" * 500 for i in range(100)))  # 12 bytes per char, encoded
    assert len(worst) < (MAX_NAME_CHARS + 5) * MAX_HEADER_NAMES + 20 and "%F0%9F%AF%B8" in worst
    assert all(not part.rstrip(".").endswith(("%", "%F")) for part in worst.split(", "))


def test_ignored_field_log_warns_once_per_name_and_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    log = IgnoredFieldLog(logging.getLogger("test.ignored"), max_names=3)
    with caplog.at_level(logging.WARNING, logger="test.ignored"):
        log.warn(("a", "b"), "/v1/x")
        log.warn(("a", "b"), "/v1/x")
        log.warn(("b", "c", "d", "e"), "/v1/x")
        log.warn(("f",), "/v1/x")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "a, b" in lines[0] and ": c (" in lines[1] and "further ones are not" in lines[2]


def test_served_answers_name_ignored_fields(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="inflight.server"):
        reply = http("POST", f"{server.url}/v1/completions",
                     {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "zq_unique_field": 1})
        again = http("POST", f"{server.url}/v1/completions",
                     {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "zq_unique_field": 1})
    assert reply.status == 200 and again.status == 200
    assert reply.headers[IGNORED_FIELDS_HEADER] == "zq_unique_field"
    assert again.headers[IGNORED_FIELDS_HEADER] == "zq_unique_field"
    warnings = [r.getMessage() for r in caplog.records if "zq_unique_field" in r.getMessage()]
    assert len(warnings) == 1 and "/v1/completions" in warnings[0]
    stream = http("POST", f"{server.url}/v1/chat/completions",
                  {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2, "stream": True, "temprature": 0})
    assert stream.status == 200 and stream.headers["Content-Type"].startswith("text/event-stream")
    assert stream.headers[IGNORED_FIELDS_HEADER] == "temprature"
    plain = http("POST", f"{server.url}/v1/completions", {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2})
    assert plain.status == 200 and IGNORED_FIELDS_HEADER not in {k.lower() for k in plain.headers}


@pytest.fixture(scope="module")
def strict_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(demo_model_dir, EngineConfig(max_num_sequences=2, num_kv_blocks=32, max_model_len=256),
                      ServerSettings(model_name=MODEL_NAME, reject_unknown_fields=True)).start()
    yield live
    live.stop()


def test_reject_unknown_fields_server(strict_server: LiveServer) -> None:
    reply = http("POST", f"{strict_server.url}/v1/completions",
                 {"model": MODEL_NAME, "prompt": "hello", "max_token": 3})
    assert reply.status == 400
    assert reply.json()["error"] == {
        "message": "Unrecognized request argument supplied: max_token (did you mean 'max_tokens'?)",
        "type": "invalid_request_error", "param": "max_token", "code": None}
    ok = http("POST", f"{strict_server.url}/v1/chat/completions",
              {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2, "temperature": 0})
    assert ok.status == 200 and json.loads(ok.text)["choices"][0]["finish_reason"] in ("length", "stop")
