"""/v1/messages on the tiny demo model: the anthropic client's typed messages, the stream's events
in order, tools (a forced call and its tool_result sent back), stop sequences, count_tokens, the
model's own sampling defaults when the client sends none, ``x-api-key``, Anthropic's error shape
for every failure (the app's 401 and 404 included), and a client that leaves mid-stream leaving
no request or KV block behind.

The prompt a Messages request renders is checked against ``/tokenize`` of the chat messages it
stands for, so the translation is exact, not just accepted.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.generation_defaults import SamplingDefaults
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.anthropic.render import MessagesRenderer
from inflight.runtime.server.errors import APIError
from tests.server.server_helpers import API_KEY, MODEL_NAME, LiveServer, http, is_idle, wait_until

anthropic = pytest.importorskip("anthropic")

CONFIG = dict(max_num_sequences=4, num_kv_blocks=128, max_model_len=1024)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Get the weather", "input_schema": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                                "description": "Get the weather"}}]
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None, path: str = "/v1/messages") -> Any:
    return http("POST", f"{url}{path}", {"model": MODEL_NAME, **body}, headers)


def _tokens(url: str, messages: list[dict[str, Any]], **extra: Any) -> int:
    reply = http("POST", f"{url}/tokenize", {"model": MODEL_NAME, "messages": messages, **extra})
    assert reply.status == 200, reply.text
    return len(reply.json()["tokens"])


def test_create_is_a_typed_message_with_usage(client: Any, server: LiveServer) -> None:
    m = client.messages.create(model=MODEL_NAME, max_tokens=5, system="Be brief.", messages=HI,
                               metadata={"user_id": "u1"}, extra_body={"temperature": 0, "top_k": 5})
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_NAME
    assert [b.type for b in m.content] in (["text"], [])
    want = _tokens(server.url, [{"role": "system", "content": "Be brief."}, *HI])
    assert m.usage.input_tokens == want and 1 <= m.usage.output_tokens <= 5
    assert m.stop_reason == ("max_tokens" if m.usage.output_tokens == 5 else "end_turn")


def test_system_as_blocks_and_count_tokens(client: Any, server: LiveServer) -> None:
    system = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    counted = client.messages.count_tokens(model=MODEL_NAME, system=system, messages=HI)
    assert counted.input_tokens == _tokens(server.url, [{"role": "system", "content": "Be brief."}, *HI])


def test_stop_sequence_is_named(client: Any, server: LiveServer) -> None:
    free = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=HI, extra_body={"temperature": 0})
    text = free.content[0].text
    stop = next(c for c in text[1:] if c.strip())  # a character the answer writes after its first
    m = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=HI, extra_body={"temperature": 0},
                               stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert text.startswith(m.content[0].text if m.content else "") and stop not in (m.content[0].text[1:] if m.content else "")


def test_stream_events_in_order(server: LiveServer, client: Any) -> None:
    reply = _post(server.url, {"max_tokens": 6, "messages": HI, "temperature": 0, "stream": True})
    assert reply.status == 200
    events = [(b.split("\n")[0].removeprefix("event: "), json.loads(b.split("\n")[1].removeprefix("data: ")))
              for b in reply.text.split("\n\n") if b.strip()]
    names = [n for n, _ in events]
    assert [d["type"] for _, d in events] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["usage"]["input_tokens"] == _tokens(server.url, HI) and start["content"] == []
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    delta = events[-2][1]
    whole = client.messages.create(model=MODEL_NAME, max_tokens=6, messages=HI, extra_body={"temperature": 0})
    assert text == whole.content[0].text and delta["delta"]["stop_reason"] == whole.stop_reason
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens


def test_stream_helper(client: Any) -> None:
    with client.messages.stream(model=MODEL_NAME, max_tokens=6, messages=HI, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and final.stop_reason in ("max_tokens", "end_turn")


def test_forced_tool_then_its_result_sent_back(client: Any, server: LiveServer) -> None:
    m = client.messages.create(model=MODEL_NAME, max_tokens=40, messages=[{"role": "user", "content": "Weather?"}],
                               tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    [use] = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and set(use.input) == {"city"}
    assert m.stop_reason == "tool_use"
    follow = client.messages.create(model=MODEL_NAME, max_tokens=3, tools=TOOLS, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}])
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function", "function": {
                   "name": "get_weather", "arguments": json.dumps(use.input)}}]},
               {"role": "tool", "tool_call_id": use.id, "name": "get_weather", "content": "18 C"}]
    assert follow.usage.input_tokens == _tokens(server.url, history, tools=CHAT_TOOLS)


def test_output_config_format_is_followed(client: Any) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    m = client.messages.create(model=MODEL_NAME, max_tokens=30, messages=HI,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(m.content[0].text)["answer"] in ("yes", "no")


def test_streamed_tool_use_input_json_adds_up(client: Any) -> None:
    with client.messages.stream(model=MODEL_NAME, max_tokens=40, messages=[{"role": "user", "content": "W?"}],
                                tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        partial = "".join(e.delta.partial_json for e in stream
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    [use] = final.content
    assert use.type == "tool_use" and use.input == json.loads(partial) and final.stop_reason == "tool_use"


@pytest.mark.parametrize("body, param_word", [
    ({"messages": HI}, "max_tokens"),
    ({"max_tokens": 4, "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"max_tokens": 4, "messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
    ({"max_tokens": 4, "messages": HI, "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 4, "messages": HI, "output_config": {"effort": "high"}}, "effort"),
])
def test_bad_requests_are_anthropic_errors(server: LiveServer, body: dict[str, Any], param_word: str) -> None:
    reply = _post(server.url, body)
    assert reply.status == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert param_word in error["error"]["message"]


def test_unknown_fields_are_named_in_a_header(server: LiveServer) -> None:
    reply = _post(server.url, {"max_tokens": 2, "messages": HI, "temprature": 0})
    assert reply.status == 200 and reply.headers["x-inflight-ignored-fields"] == "temprature"


def test_client_raises_typed_errors(client: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL_NAME, max_tokens=0, messages=HI)
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=HI)


def test_x_api_key_is_the_api_key(keyed_server: LiveServer) -> None:
    body = {"max_tokens": 2, "messages": HI}
    missing = _post(keyed_server.url, body)
    assert missing.status == 401 and missing.json()["error"]["type"] == "authentication_error"
    assert missing.json()["type"] == "error"
    assert _post(keyed_server.url, body, {"x-api-key": "wrong"}).status == 401
    keyed = anthropic.Anthropic(base_url=keyed_server.url, api_key=API_KEY, max_retries=0, timeout=120)
    assert keyed.messages.create(model=MODEL_NAME, max_tokens=2, messages=HI).usage.output_tokens >= 1


def test_unsent_sampling_fields_take_the_model_defaults(demo_model_dir: Path) -> None:
    """The 2.x client sends no temperature: the server's defaults (the model's generation_config)
    apply, exactly as for a chat request that leaves them out."""
    defaults = SamplingDefaults(temperature=0.0, source="test")
    live = LiveServer(demo_model_dir, EngineConfig(**CONFIG),
                      ServerSettings(model_name=MODEL_NAME, sampling_defaults=defaults)).start()
    try:
        client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)
        texts = {client.messages.create(model=MODEL_NAME, max_tokens=8, messages=HI).content[0].text
                 for _ in range(3)}
        chat = http("POST", f"{live.url}/v1/chat/completions", {"model": MODEL_NAME, "messages": HI, "max_tokens": 8})
        assert texts == {chat.json()["choices"][0]["message"]["content"]}
    finally:
        live.stop()


def test_thinking_and_auto_calls_render_as_blocks() -> None:
    renderer = MessagesRenderer(MODEL_NAME, ())
    chat = {"usage": {"prompt_tokens": 3, "completion_tokens": 5}, "choices": [{
        "finish_reason": "tool_calls", "message": {"content": "ok", "reasoning_content": "hmm", "tool_calls": [
            {"id": "call_1", "function": {"name": "f", "arguments": '{"a": 1}'}}]}}]}
    body = renderer.body(chat)
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][2]["input"] == {"a": 1} and body["stop_reason"] == "tool_use"
    stream = renderer.stream({}, 3)
    raw = stream.opening() + stream.choice({"delta": {"reasoning_content": "hmm", "content": "ok"},
                                            "finish_reason": None})
    raw += stream.choice({"delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {
        "name": "f", "arguments": '{"a": 1}'}}]}, "finish_reason": "tool_calls"})
    raw += stream.closing({"prompt_tokens": 3, "completion_tokens": 5})
    events = [json.loads(b.split(b"data: ", 1)[1]) for b in raw.split(b"\n\n") if b]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


@pytest.fixture(scope="module")
def slow(demo_model_dir: Path) -> Iterator[LiveServer]:
    server = LiveServer(demo_model_dir, EngineConfig(**CONFIG), ServerSettings(model_name=MODEL_NAME),
                        fault="slow-steps:20").start()
    yield server
    server.stop()


def test_client_leaving_mid_stream_frees_everything(slow: LiveServer) -> None:
    async def leave_early() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{slow.url}/v1/messages", json={
                    "model": MODEL_NAME, "messages": HI, "stream": True, "max_tokens": 200}) as r:
                assert r.status == 200
                async for line in r.content:
                    if b"content_block_delta" in line:
                        break

    asyncio.run(asyncio.wait_for(leave_early(), 60))
    assert wait_until(lambda: is_idle(slow.url), 60)


def test_failures_keep_the_anthropic_shape(server: LiveServer) -> None:
    """A body that is not JSON and an unknown route under /v1/messages (the app's own errors), and
    an error event after a stream started."""
    reply = http("POST", f"{server.url}/v1/messages", b"{not json")
    assert reply.status == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert reply.json()["type"] == "error" and "JSON" in reply.json()["error"]["message"]
    missing = http("POST", f"{server.url}/v1/messages/nope", {})
    assert missing.status == 404 and missing.json()["error"]["type"] == "not_found_error"
    stream = MessagesRenderer(MODEL_NAME, ()).stream({}, 1)
    event = stream.failure(APIError(503, "the engine has stopped", "service_unavailable_error"))
    name, data = event.decode().strip().split("\n")
    assert name == "event: error" and json.loads(data.removeprefix("data: ")) == {
        "type": "error", "error": {"type": "overloaded_error", "message": "the engine has stopped"}}
