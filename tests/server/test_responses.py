"""Response building without an engine: SSE framing, usage counting, both logprobs layouts,
and the OpenAI error shape."""

from __future__ import annotations

import json

from inflight.runtime.outputs import (
    QueueFullError,
    RequestOutput,
    RequestRejectedError,
    TokenLogprob,
)
from inflight.runtime.server import errors
from inflight.runtime.server.openai import responses, streaming

META = {"id": "cmpl-1", "created": 1, "model": "demo"}
TEXT = {1: "a", 2: "bc", 3: "d"}.get


def out(req_id: str, text: str, ids: tuple[int, ...], n_out: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(req_id, ids, text, finished, "length" if finished else None, 5, n_out, 0,
                         tuple(TokenLogprob(t, -0.5, ((t, -0.5), (3, -1.0))) for t in ids))


def test_sse_event_framing() -> None:
    event = streaming.sse_event({"a": 1, "b": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[6:]) == {"a": 1, "b": "é"}
    assert streaming.DONE == b"data: [DONE]\n\n"


def test_choice_accumulates_and_usage_counts_prompts_once() -> None:
    a, b = responses.ChoiceState(0, "r-0"), responses.ChoiceState(1, "r-1")
    a.add(out("r-0", "a", (1,), 1))
    a.add(out("r-0", "bc", (2,), 2, finished=True))
    b.add(out("r-1", "d", (3,), 1, finished=True))
    assert (a.text, a.finish_reason, a.num_output_tokens) == ("abc", "length", 2)
    assert responses.usage([5], [a, b]) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    body = responses.completion_body(META, [a, b], [5], TEXT)
    assert [c["text"] for c in body["choices"]] == ["abc", "d"]
    assert body["choices"][0]["logprobs"]["tokens"] == ["a", "bc"]
    assert body["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert body["choices"][0]["logprobs"]["top_logprobs"][0] == {"a": -0.5, "d": -1.0}
    assert responses.completion_body(META, [a], [5], None)["choices"][0]["logprobs"] is None


def test_chat_logprobs_layout() -> None:
    layout = responses.chat_logprobs([TokenLogprob(2, -0.1, ((2, -0.1), (1, -2.0)))], TEXT)
    (item,) = layout["content"]
    assert item == {"token": "bc", "logprob": -0.1, "bytes": [98, 99], "top_logprobs": [
        {"token": "bc", "logprob": -0.1, "bytes": [98, 99]},
        {"token": "a", "logprob": -2.0, "bytes": [97]},
    ]}


def test_chunks() -> None:
    completion = streaming.ChunkFormat(META, "text_completion", False)
    chunk = json.loads(completion.event(responses.completion_delta(2, "d", [], None, "length"))[6:])
    assert chunk["choices"] == [{"index": 2, "text": "d", "logprobs": None, "finish_reason": "length"}]
    chat_format = streaming.ChunkFormat(META, "chat.completion.chunk", False)
    chat = json.loads(chat_format.event(responses.chat_delta(0, {"content": "x"}, None))[6:])
    assert chat["object"] == "chat.completion.chunk" and chat["choices"][0]["delta"] == {"content": "x"}
    usage = responses.usage_chunk(META, "text_completion", {"prompt_tokens": 1})
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 1}


def test_error_shapes() -> None:
    full = errors.queue_full("busy")
    assert (full.status, full.headers["Retry-After"], full.type) == (429, "1", "rate_limit_error")
    assert errors.from_rejection(QueueFullError(3), "prompt").status == 429
    too_long = errors.from_rejection(RequestRejectedError("too long", "prompt_too_long"), "messages")
    assert (too_long.status, too_long.param, too_long.code) == (400, "messages", "prompt_too_long")
    draining = errors.unavailable("bye", "draining")
    assert draining.status == 503 and "Retry-After" in draining.headers
    body = json.loads(errors.internal_error().to_response().text)
    assert set(body["error"]) == {"message", "type", "param", "code"}
