"""Streams that coalesce, on a live server: a reader that falls behind gets merged chunks that
lose nothing, and ``stream_interval`` N sends chunks of at least N tokens but the first and
the last, for completions, chat (logprobs, n > 1, usage) and streamed tool calls.

The reader is made to fall behind by holding the server's event loop while the engine, held
and released between steps, makes several steps: never by timing."""

from __future__ import annotations

import json
import re
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inflight.runtime import chat_templates
from inflight.runtime.cli.serving_dir import read_chat_template, serving_dir
from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.state import STATE
from tests.server.server_helpers import MODEL_NAME, LiveServer, http, wait_until

INTERVAL = 4
CONFIG = dict(max_num_sequences=4, num_kv_blocks=128, max_model_len=512)
HOLD_TIMEOUT_S = 120.0  # only so that a failing test cannot hold the server's loop for ever


@pytest.fixture(scope="module")
def interval_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(demo_model_dir, EngineConfig(**CONFIG),
                      ServerSettings(model_name=MODEL_NAME, stream_interval=INTERVAL)).start()
    yield live
    live.stop()


def _open(url: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps({"model": MODEL_NAME, **body}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    return urllib.request.urlopen(request, timeout=120)  # noqa: S310 - 127.0.0.1 only


def _next_event(resp: Any) -> dict[str, Any] | None:
    """The next event's JSON; None at ``[DONE]``."""
    while True:
        line = resp.readline()
        assert line, "the stream ended without [DONE]"
        if line.startswith(b"data: "):
            data = line[6:].strip()
            return None if data == b"[DONE]" else json.loads(data)


def _events(resp: Any) -> list[dict[str, Any]]:
    events = []
    while (event := _next_event(resp)) is not None:
        events.append(event)
    return events


def _num_steps(live: LiveServer) -> int:
    with live.app[STATE].engine.between_steps() as engine:
        return engine.stats().num_steps


def _engine_steps_while_the_loop_is_held(live: LiveServer, num_steps: int) -> None:
    """Hold the engine between steps, then the server's event loop; let the engine make
    ``num_steps`` steps while the loop stays held (their outputs pile up), then let the loop go."""
    loop_held, release = threading.Event(), threading.Event()

    def hold() -> None:  # runs on the server's event loop and blocks it
        loop_held.set()
        release.wait(HOLD_TIMEOUT_S)

    with live.app[STATE].engine.between_steps() as engine:
        start = engine.stats().num_steps
        live.loop.call_soon_threadsafe(hold)
        assert loop_held.wait(HOLD_TIMEOUT_S)
    try:
        assert wait_until(lambda: _num_steps(live) >= start + num_steps, HOLD_TIMEOUT_S, 0.002)
    finally:
        release.set()


def _completion_tokens(event: dict[str, Any]) -> int:
    return len(event["choices"][0]["logprobs"]["tokens"])


def test_a_reader_that_falls_behind_gets_merged_chunks_that_lose_nothing(server: LiveServer) -> None:
    body = {"prompt": "# coalesce\n", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    whole = http("POST", f"{server.url}/v1/completions", body).json()
    with _open(server.url, "/v1/completions",
               {**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        first = _next_event(resp)
        assert first is not None
        _engine_steps_while_the_loop_is_held(server, 6)
        events = [first, *_events(resp)]
    usage = events[-1]["usage"]
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    counts = [_completion_tokens(c) for c in chunks]
    assert sum(counts) == usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 400
    assert max(counts) >= 6  # the steps made while the loop was held came in one chunk
    assert len(chunks) < 400
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]  # logprobs stay with their tokens
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("length") == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _check_interval(counts: list[int]) -> None:
    """The first chunk goes without waiting for N tokens (it holds more than one only when the
    reader fell behind) and the last may be short; every other holds at least N."""
    assert len(counts) >= 3 and all(n >= INTERVAL for n in counts[1:-1]), counts


@pytest.mark.parametrize("with_stop", [False, True])
def test_interval_completion_chunks_hold_n_tokens_and_lose_nothing(interval_server: LiveServer,
                                                                   with_stop: bool) -> None:
    body: dict[str, Any] = {"prompt": "# interval\n", "max_tokens": 37, "temperature": 0, "ignore_eos": True,
                            "logprobs": 0, "n": 2}
    if with_stop:  # a stop string from the middle of the output: held text is cut there, never lost
        text = http("POST", f"{interval_server.url}/v1/completions", {**body, "n": 1}).json()["choices"][0]["text"]
        stop = text[9:12]
        assert len(stop) == 3 and text.find(stop) >= 9 or pytest.skip("no usable stop string in this output")
        body["stop"] = [stop]
    whole = http("POST", f"{interval_server.url}/v1/completions", body).json()
    with _open(interval_server.url, "/v1/completions",
               {**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        events = _events(resp)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in chunks) == whole["choices"][index]["text"]
        counts = [len(c["logprobs"]["tokens"]) for c in chunks]
        if not with_stop:
            _check_interval(counts)
            assert sum(counts) == 37
        assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [whole["choices"][index]["finish_reason"]]


def test_interval_chat_chunks_keep_logprobs_and_content(interval_server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 30, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 1}
    whole = http("POST", f"{interval_server.url}/v1/chat/completions", body).json()
    with _open(interval_server.url, "/v1/chat/completions",
               {**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        events = _events(resp)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e.get("usage", "absent") is None for e in events[:-1])  # include_usage: null on each chunk
    assert events[-1]["usage"] == whole["usage"]
    chunks = [e["choices"][0] for e in events[1:-1]]
    assert "".join(c["delta"].get("content", "") for c in chunks) == whole["choices"][0]["message"]["content"]
    _check_interval([len(c["logprobs"]["content"]) for c in chunks])
    merged = [item for c in chunks for item in c["logprobs"]["content"]]
    assert merged == whole["choices"][0]["logprobs"]["content"]
    assert chunks[-1]["finish_reason"] == "length"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tools_interval_server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    template = read_chat_template(chat_templates.resolve("smollm2-tools"))
    model_dir = serving_dir(demo_model_dir, None, template, root=tmp_path_factory.mktemp("tools-interval"))
    live = LiveServer(model_dir, EngineConfig(**CONFIG),
                      ServerSettings(model_name=MODEL_NAME, stream_interval=INTERVAL, enable_auto_tool_choice=True,
                                     tool_call_parser="hermes")).start()
    yield live
    live.stop()


def test_interval_streams_tool_calls_whole(tools_interval_server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 80, "guided_regex": "Sure\\.\\n" + re.escape(CALL)}
    whole = http("POST", f"{tools_interval_server.url}/v1/chat/completions", body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    with _open(tools_interval_server.url, "/v1/chat/completions", {**body, "stream": True}) as resp:
        events = _events(resp)
    deltas = [e["choices"][0]["delta"] for e in events]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]]
    assert "".join(d.get("content") or "" for d in deltas) == whole["message"]["content"] == "Sure.\n"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"][0]["finish_reason"]] == ["tool_calls"]
