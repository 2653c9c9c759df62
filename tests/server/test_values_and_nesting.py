"""Values the JSON parser lets through but a float or a parser cannot hold: a 400 naming the
field, never a 500. Integers too large for a float in every float field; JSON nested
thousands of levels deep *inside a string* (a schema given as text, a history tool call's
arguments), on the generation endpoints and /tokenize; a temperature so small it would turn
logits into NaN; more sequences in one request than one request may ask for; a response
whose worst case holds more tokens and logprob alternatives than one response may."""

from __future__ import annotations

import pytest

from tests.server.server_helpers import MODEL_NAME, LiveServer, http

C = "/v1/completions"
CHAT = "/v1/chat/completions"
HUGE = int("9" * 400)
DEEP = "[" * 5000 + "]" * 5000  # far past the recursion limit of json.loads
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


def _error(reply, param: str) -> dict[str, object]:
    assert reply.status == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert "Traceback" not in error["message"] and len(error["message"]) < 500
    return error


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_an_integer_too_large_for_a_float_is_400(server: LiveServer, field: str) -> None:
    for path, body in ((C, {"prompt": "x"}), (CHAT, {"messages": [{"role": "user", "content": "x"}]})):
        reply = http("POST", server.url + path, {"model": MODEL_NAME, "max_tokens": 2, **body, field: HUGE})
        _error(reply, field)


NESTED_IN_STRINGS = [
    ("guided_json", C, {"prompt": "x", "guided_json": DEEP}, "guided_json"),
    ("structured_outputs.json", C, {"prompt": "x", "structured_outputs": {"json": DEEP}}, "structured_outputs"),
    ("history tool-call arguments", CHAT, {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                               "function": {"name": "f", "arguments": DEEP}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "messages"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in NESTED_IN_STRINGS],
                         ids=[c[0] for c in NESTED_IN_STRINGS])  # fmt: skip
def test_json_nested_deep_inside_a_string_is_400(server: LiveServer, path: str, body: dict, param: str) -> None:
    reply = http("POST", server.url + path, {"model": MODEL_NAME, "max_tokens": 2, **body})
    error = _error(reply, param)
    assert "nested" in str(error["message"]) or "JSON" in str(error["message"])


def test_tokenize_refuses_deep_json_in_a_history_tool_call(server: LiveServer) -> None:
    body = dict(NESTED_IN_STRINGS[2][2], model=MODEL_NAME)
    _error(http("POST", server.url + "/tokenize", body), "messages")


def test_a_vanishing_temperature_is_greedy(server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "def fib(n):", "max_tokens": 8, "ignore_eos": True}
    greedy = http("POST", server.url + C, {**body, "temperature": 0}).json()["choices"][0]["text"]
    tiny = http("POST", server.url + C, {**body, "temperature": 1e-300}).json()["choices"][0]["text"]
    assert tiny == greedy and tiny  # not NaN logits picking token 0 every step


def test_too_many_sequences_in_one_request_is_400(server: LiveServer) -> None:
    reply = http("POST", server.url + C, {"model": MODEL_NAME, "prompt": ["a"] * 20, "n": 16, "max_tokens": 1})
    error = _error(reply, "n")
    assert "320 sequences" in str(error["message"])


def _logprob_body(max_tokens: int) -> dict[str, object]:
    """2 token-id prompts of 10 x n=2; per sequence max_tokens x (1 + 2) + 10 x (1 + 1) entries."""
    prompts = [list(range(5, 15)), list(range(20, 30))]
    return {"model": MODEL_NAME, "prompt": prompts, "n": 2, "max_tokens": max_tokens, "logprobs": 2,
            "prompt_logprobs": 1, "temperature": 0, "ignore_eos": True}


def test_a_response_at_the_size_ceiling_is_served_and_one_past_it_is_400(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inflight.runtime.server.openai import generation

    monkeypatch.setattr(generation, "MAX_RESPONSE_ENTRIES", 4 * (3 * 3 + 10 * 2))  # 116: max_tokens=3 fits
    reply = http("POST", server.url + C, _logprob_body(3))
    assert reply.status == 200, reply.text[:300]
    assert len(reply.json()["choices"]) == 4
    error = _error(http("POST", server.url + C, _logprob_body(4)), "prompt_logprobs")  # 4 x 32 = 128
    message = str(error["message"])
    assert error["code"] == "response_too_large"
    for named in ("128", "116", "n=2", "2 prompt(s)", "max_tokens=4", "logprobs=2", "prompt_logprobs=1"):
        assert named in message, (named, message)


def test_the_largest_prompt_logprobs_product_is_refused_before_any_work(server: LiveServer) -> None:
    # 16 prompts of 500 tokens x n=16 x prompt_logprobs=20: 256 x (1 + 500 x 21) = 2,688,256 entries.
    prompts = [[(7 * i + j) % 200 + 3 for j in range(500)] for i in range(16)]
    body = {"model": MODEL_NAME, "prompt": prompts, "n": 16, "max_tokens": 1, "prompt_logprobs": 20}
    error = _error(http("POST", server.url + C, body), "prompt_logprobs")
    assert "2,688,256" in str(error["message"]) and "2,097,152" in str(error["message"])
