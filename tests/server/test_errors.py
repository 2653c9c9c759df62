"""A table of bad requests against the live server: each has an exact HTTP status, an OpenAI
error body (``{"error": {"message", "type", "param", "code"}}``) and never a traceback."""

from __future__ import annotations

import pytest

from tests.server.server_helpers import ADMIN_AUTH, API_KEY, MODEL_NAME, LiveServer, Reply, http

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MSG = [{"role": "user", "content": "hi"}]
BAD = "invalid_request_error"


def comp(**fields: object) -> dict[str, object]:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, **fields}


def chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL_NAME, "messages": OK_MSG, "max_tokens": 4, **fields}


# (case id, method, path, body (bytes are sent raw), status, error type, param)
CASES = [
    ("malformed-json", "POST", C, b'{"prompt": "x",', 400, BAD, None),
    ("body-not-object", "POST", C, b"[1, 2]", 400, BAD, None),
    ("unknown-model", "POST", C, comp(model="gpt-9"), 404, BAD, "model"),  # model_not_found, as OpenAI
    ("missing-prompt", "POST", C, {"model": MODEL_NAME}, 400, BAD, "prompt"),
    ("prompt-wrong-type", "POST", C, comp(prompt=3), 400, BAD, "prompt"),
    ("prompt-mixed-list", "POST", C, comp(prompt=["a", 1]), 400, BAD, "prompt"),
    ("prompt-empty-list", "POST", C, comp(prompt=[]), 400, BAD, "prompt"),
    ("prompt-empty-string", "POST", C, comp(prompt=""), 400, BAD, "prompt"),
    ("token-id-negative", "POST", C, comp(prompt=[1, -5]), 400, BAD, "prompt"),
    ("token-id-out-of-vocab", "POST", C, comp(prompt=[1, 10**6]), 400, BAD, "prompt"),
    ("prompt-too-long", "POST", C, comp(prompt=list(range(3, 603))), 400, BAD, "prompt"),
    ("max-tokens-past-context", "POST", C, comp(max_tokens=100_000), 400, BAD, "max_tokens"),
    ("max-tokens-zero", "POST", C, comp(max_tokens=0), 400, BAD, "max_tokens"),
    ("max-tokens-string", "POST", C, comp(max_tokens="ten"), 400, BAD, "max_tokens"),
    ("temperature-too-high", "POST", C, comp(temperature=3.5), 400, BAD, "temperature"),
    ("top-p-zero", "POST", C, comp(top_p=0), 400, BAD, "top_p"),
    ("top-k-below-minus-one", "POST", C, comp(top_k=-2), 400, BAD, "top_k"),
    ("presence-penalty-range", "POST", C, comp(presence_penalty=5), 400, BAD, "presence_penalty"),
    ("n-zero", "POST", C, comp(n=0), 400, BAD, "n"),
    ("n-too-large", "POST", C, comp(n=1000), 400, BAD, "n"),
    ("stop-empty-string", "POST", C, comp(stop=[""]), 400, BAD, "stop"),
    ("stop-too-many", "POST", C, comp(stop=[f"s{i}" for i in range(17)]), 400, BAD, "stop"),
    ("logprobs-too-many", "POST", C, comp(logprobs=21), 400, BAD, "logprobs"),
    ("min-tokens-over-max", "POST", C, comp(min_tokens=9), 400, BAD, "min_tokens"),
    ("seed-not-int", "POST", C, comp(seed="x"), 400, BAD, "seed"),
    ("stream-not-bool", "POST", C, comp(stream="yes"), 400, BAD, "stream"),
    ("stream-options-without-stream", "POST", C, comp(stream_options={"include_usage": True}),
     400, BAD, "stream_options"),
    ("suffix-unsupported", "POST", C, comp(suffix="x"), 400, BAD, "suffix"),
    ("echo-stream-unsupported", "POST", C, comp(echo=True, stream=True), 400, BAD, "echo"),
    ("chat-missing-messages", "POST", CHAT, {"model": MODEL_NAME}, 400, BAD, "messages"),
    ("chat-bad-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, BAD, "messages"),
    ("chat-image-part", "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, BAD, "messages"),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, chat(top_logprobs=2), 400, BAD, "top_logprobs"),
    ("chat-logprobs-not-bool", "POST", CHAT, chat(logprobs=3), 400, BAD, "logprobs"),
    ("chat-prompt-too-long", "POST", CHAT, chat(messages=[{"role": "user", "content": "x " * 600}]),
     400, BAD, "messages"),
    ("chat-no-room-left", "POST", CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x " * 600}]},
     400, BAD, "messages"),
    ("chat-max-completion-tokens-zero", "POST", CHAT, chat(max_completion_tokens=0), 400, BAD,
     "max_completion_tokens"),
    ("unknown-route", "GET", "/v1/nothing", None, 404, "not_found_error", None),
    ("wrong-method", "GET", C, None, 405, BAD, None),
    ("body-too-large", "POST", C, comp(prompt="x" * 70_000), 413, BAD, None),
    ("admin-non-live-field", "POST", "/admin/config", {"block_size": 32}, 400, BAD, "block_size"),
    ("admin-bad-value", "POST", "/admin/config", {"max_num_sequences": 0}, 400, BAD, "max_num_sequences"),
]


def check_error(reply: Reply, status: int, error_type: str, param: str | None) -> None:
    assert reply.status == status, reply.text
    assert "Traceback" not in reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["param"] == param
    assert isinstance(error["message"], str) and len(error["message"]) > 10


@pytest.mark.parametrize(("method", "path", "body", "status", "error_type", "param"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(server: LiveServer, method: str, path: str, body: object, status: int,
                     error_type: str, param: str | None) -> None:
    headers = ADMIN_AUTH if path.startswith("/admin/") else None
    check_error(http(method, server.url + path, body, headers), status, error_type, param)


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 20


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}],
                         ids=["no-key", "wrong-key", "no-bearer-scheme"])
@pytest.mark.parametrize("path", [C, CHAT, "/v1/models", "/admin/config"])
def test_key_required(keyed_server: LiveServer, headers: dict[str, str], path: str) -> None:
    method = "GET" if path in ("/v1/models", "/admin/config") else "POST"
    body = chat() if path == CHAT else comp() if path == C else None
    reply = http(method, keyed_server.url + path, body, headers)
    check_error(reply, 401, "authentication_error", None)


def test_right_key_and_open_probes(keyed_server: LiveServer) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert http("POST", keyed_server.url + C, comp(), auth).status == 200
    for probe in ("/health", "/ready"):  # probes need no key
        assert http("GET", keyed_server.url + probe).status == 200
    assert http("GET", keyed_server.url + "/metrics").status == 401  # the server has a key: so has /metrics
    assert http("GET", keyed_server.url + "/metrics", headers=auth).status == 200
