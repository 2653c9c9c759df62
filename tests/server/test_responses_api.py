"""/v1/responses on the tiny demo model: the openai client's typed objects, the stream's events in
order with their sequence numbers, tools (a forced call and its output sent back), structured
output, the bounded store behind ``previous_response_id``, every refused field naming itself,
and a client that leaves mid-stream leaving no request or KV block behind.

The prompt a Responses request renders is checked against ``/tokenize`` of the chat messages it
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
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.responses_api.render import ResponsesRenderer
from inflight.runtime.server.responses_api.store import ResponseStore
from tests.server.server_helpers import MODEL_NAME, LiveServer, http, is_idle, wait_until

openai = pytest.importorskip("openai")

CONFIG = dict(max_num_sequences=4, num_kv_blocks=128, max_model_len=1024)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the weather", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
                                                "parameters": WEATHER}}]
STORE_SIZE = 2


@pytest.fixture(scope="module")
def live(demo_model_dir: Path) -> Iterator[LiveServer]:
    """A server with the responses store on, bounded to ``STORE_SIZE``, refusing unknown fields."""
    server = LiveServer(demo_model_dir, EngineConfig(**CONFIG),
                        ServerSettings(model_name=MODEL_NAME, responses_store_size=STORE_SIZE,
                                       reject_unknown_fields=True)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Any:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _post(url: str, body: dict[str, Any]) -> Any:
    return http("POST", f"{url}/v1/responses", {"model": MODEL_NAME, **body})


def _events(url: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    reply = _post(url, {**body, "stream": True})
    assert reply.status == 200, reply.text
    events = []
    for block in reply.text.split("\n\n"):
        if block.strip():
            name, data = block.split("\n", 1)
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def _tokens(url: str, messages: list[dict[str, Any]], **extra: Any) -> int:
    reply = http("POST", f"{url}/tokenize", {"model": MODEL_NAME, "messages": messages, **extra})
    assert reply.status == 200, reply.text
    return len(reply.json()["tokens"])


def test_create_is_a_typed_response_with_usage(client: Any, live: LiveServer) -> None:
    r = client.responses.create(model=MODEL_NAME, input="Hello there", instructions="Be brief.",
                                max_output_tokens=6, temperature=0, extra_body={"min_tokens": 6})
    assert r.object == "response" and r.model == MODEL_NAME and r.store is True
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text and r.output_text
    want = _tokens(live.url, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (want, 6, want + 6)
    assert r.instructions == "Be brief." and r.max_output_tokens == 6 and r.temperature == 0


def test_stream_events_in_order_with_sequence_numbers(live: LiveServer, client: Any) -> None:
    body = {"input": "Hello there", "max_output_tokens": 8, "temperature": 0, "min_tokens": 8}
    events = _events(live.url, body)
    names = [name for name, _ in events]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    deltas = [i for i, n in enumerate(names) if n == "response.output_text.delta"]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert deltas == list(range(4, 4 + len(deltas))) and deltas
    assert names[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.incomplete"]
    text = "".join(events[i][1]["delta"] for i in deltas)
    final = events[-1][1]["response"]
    assert events[4 + len(deltas)][1]["text"] == text == final["output"][0]["content"][0]["text"]
    assert final["usage"]["output_tokens"] == 8
    assert text == client.responses.create(model=MODEL_NAME, **{k: v for k, v in body.items() if k != "min_tokens"},
                                           extra_body={"min_tokens": 8}).output_text


def test_stream_helper_gives_the_final_response(client: Any) -> None:
    with client.responses.stream(model=MODEL_NAME, input="Hi", max_output_tokens=40, temperature=0) as stream:
        kinds = [event.type for event in stream]
    assert kinds[0] == "response.created"
    if kinds[-1] == "response.completed":  # the model stopped by itself: the helper's final response
        assert stream.get_final_response().status == "completed"
    else:
        assert kinds[-1] == "response.incomplete"


def test_forced_call_then_its_output_sent_back(client: Any, live: LiveServer) -> None:
    r = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=TOOLS, max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_weather"})
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    follow = client.responses.create(model=MODEL_NAME, tools=TOOLS, max_output_tokens=4, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "18 C, sunny"}]
    assert follow.usage.input_tokens == _tokens(live.url, history, tools=CHAT_TOOLS)


def test_streamed_call_arguments_add_up(live: LiveServer) -> None:
    events = _events(live.url, {"input": "Weather?", "tools": TOOLS, "max_output_tokens": 40,
                                "tool_choice": {"type": "function", "name": "get_weather"}})
    names = [name for name, _ in events]
    added = events[names.index("response.output_item.added")][1]["item"]
    assert added["type"] == "function_call" and added["name"] == "get_weather"
    args = "".join(d["delta"] for n, d in events if n == "response.function_call_arguments.delta")
    done = events[names.index("response.function_call_arguments.done")][1]
    assert done["arguments"] == args and set(json.loads(args)) == {"city"}
    item = events[names.index("response.output_item.done")][1]["item"]
    assert item["id"] == added["id"] and item["arguments"] == args
    assert names[-1] == "response.completed" and events[-1][1]["response"]["output"] == [item]


def test_text_format_json_schema_is_followed(client: Any) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL_NAME, input="Yes or no?", max_output_tokens=30, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert json.loads(r.output_text)["answer"] in ("yes", "no")


def test_previous_response_id_continues_the_conversation(client: Any, live: LiveServer) -> None:
    first = client.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=3, extra_body={"min_tokens": 3})
    second = client.responses.create(model=MODEL_NAME, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=2)
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    assert second.usage.input_tokens == _tokens(live.url, history)
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_store_is_bounded_least_recent_out(live: LiveServer) -> None:
    ids = [_post(live.url, {"input": f"n{i}", "max_output_tokens": 1}).json()["id"] for i in range(STORE_SIZE + 1)]
    assert http("GET", f"{live.url}/v1/responses/{ids[0]}").status == 404
    assert all(http("GET", f"{live.url}/v1/responses/{i}").status == 200 for i in ids[1:])
    reply = _post(live.url, {"input": "x", "previous_response_id": ids[0], "max_output_tokens": 1})
    assert reply.status == 400 and reply.json()["error"]["param"] == "previous_response_id"
    unstored = _post(live.url, {"input": "x", "store": False, "max_output_tokens": 1}).json()
    assert unstored["store"] is False and http("GET", f"{live.url}/v1/responses/{unstored['id']}").status == 404


def test_store_lru_unit() -> None:
    store = ResponseStore(2)
    for name in "abc":
        if name == "c":
            assert store.get("a") is not None  # a is now more recent than b
        store.put({"id": name, "output": [{"type": "message"}]}, [{"role": "user", "content": name}])
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.get("c").items == ({"role": "user", "content": "c"}, {"type": "message"})
    with pytest.raises(ValueError):
        ResponseStore(0)


@pytest.mark.parametrize("extra, param", [
    ({"backgroud": True}, "backgroud"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
])
def test_unsupported_fields_are_refused_by_name(live: LiveServer, extra: dict[str, Any], param: str) -> None:
    reply = _post(live.url, {"input": "hi", "max_output_tokens": 2, **extra})
    assert reply.status == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_unknown_fields_follow_the_server_policy(server: LiveServer, live: LiveServer) -> None:
    """Named in the header (and logged) by default; OpenAI's 400 with --reject-unknown-fields."""
    reply = _post(server.url, {"input": "hi", "max_output_token": 2, "max_output_tokens": 1})
    assert reply.status == 200 and reply.headers["x-inflight-ignored-fields"] == "max_output_token"
    refused = _post(live.url, {"input": "hi", "max_output_token": 2}).json()["error"]
    assert refused["param"] == "max_output_token" and "Unrecognized request argument" in refused["message"]


def test_without_the_store_previous_response_id_says_so(server: LiveServer) -> None:
    for extra in ({"previous_response_id": "resp_1"}, {"store": True}):
        reply = _post(server.url, {"input": "hi", **extra})
        assert reply.status == 400 and "--enable-responses-store" in reply.json()["error"]["message"]
    plain = _post(server.url, {"input": "hi", "max_output_tokens": 1}).json()
    assert plain["store"] is False
    assert http("GET", f"{server.url}/v1/responses/{plain['id']}").status == 404


def test_reasoning_and_auto_calls_render_as_items() -> None:
    """The model's split reasoning and parsed calls (what a reasoning or auto-tool model gives)."""
    renderer = ResponsesRenderer({"tools": []}, MODEL_NAME)
    chat = {"created": 1, "usage": {"prompt_tokens": 3, "completion_tokens": 5}, "choices": [{
        "finish_reason": "tool_calls", "message": {"content": "", "reasoning_content": "think", "tool_calls": [
            {"id": "call_1", "function": {"name": "f", "arguments": "{}"}}]}}]}
    body = renderer.body(chat)
    assert [i["type"] for i in body["output"]] == ["reasoning", "function_call"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert body["status"] == "completed" and body["store"] is False
    stream = renderer.stream({"created": 1}, 3)
    raw = stream.opening() + stream.choice({"delta": {"reasoning_content": "th"}, "finish_reason": None})
    raw += stream.choice({"delta": {"reasoning_content": "ink", "content": "Hi"}, "finish_reason": None})
    raw += stream.choice({"delta": {"tool_calls": [{"index": 0, "id": "call_1", "function": {
        "name": "f", "arguments": "{}"}}]}, "finish_reason": "tool_calls"})
    raw += stream.closing({"prompt_tokens": 3, "completion_tokens": 5})
    events = [json.loads(b.split(b"data: ", 1)[1]) for b in raw.split(b"\n\n") if b]
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "think" and final["usage"]["total_tokens"] == 8


@pytest.fixture(scope="module")
def slow(demo_model_dir: Path) -> Iterator[LiveServer]:
    """Every step slowed by an injected fault, so a stream is still running when its client leaves."""
    server = LiveServer(demo_model_dir, EngineConfig(**CONFIG), ServerSettings(model_name=MODEL_NAME),
                        fault="slow-steps:20").start()
    yield server
    server.stop()


def test_client_leaving_mid_stream_frees_everything(slow: LiveServer) -> None:
    async def leave_early() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{slow.url}/v1/responses", json={
                    "model": MODEL_NAME, "input": "Hi", "stream": True, "max_output_tokens": 200, "min_tokens": 200}) as r:
                assert r.status == 200
                async for line in r.content:
                    if b"response.output_text.delta" in line:
                        break

    asyncio.run(asyncio.wait_for(leave_early(), 60))
    assert wait_until(lambda: is_idle(slow.url), 60)


def test_store_flags_map_onto_the_setting() -> None:
    from inflight.runtime.cli.command import build_parser, server_settings_from_args

    def settings(*argv: str) -> ServerSettings:
        return server_settings_from_args(build_parser().parse_args(["serve", "--model", "m", *argv]))

    assert settings().responses_store_size == 0
    assert settings("--enable-responses-store").responses_store_size == 1024
    assert settings("--enable-responses-store", "--responses-store-size", "5").responses_store_size == 5
    assert settings("--responses-store-size", "5").responses_store_size == 5  # the size enables it too
    with pytest.raises(SystemExit):
        settings("--enable-responses-store", "--responses-store-size", "0")


def test_error_after_the_stream_started_is_an_error_event() -> None:
    from inflight.runtime.server.errors import unavailable

    stream = ResponsesRenderer({}, MODEL_NAME).stream({"created": 1}, 1)
    stream.opening()
    name, data = stream.failure(unavailable("the server is shutting down", "drain_timeout")).decode().strip().split("\n")
    assert name == "event: error" and json.loads(data.removeprefix("data: ")) == {
        "type": "error", "sequence_number": 2, "code": "drain_timeout", "message": "the server is shutting down",
        "param": None}
