"""Hostile input at the HTTP layer: every malformed body, header or encoding gets a 4xx in the
OpenAI error shape (never a 500, never an echo of the input or of a key), parameters the loaded
model cannot run are refused before they reach the engine, refusals and aborts are counted,
and the connection-level bounds (header/body read timeouts, idle keep-alive) hold."""

from __future__ import annotations

import gzip
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from tests.server.server_helpers import (
    API_KEY,
    MODEL_NAME,
    LiveServer,
    http,
    is_idle,
    metrics,
    post_bytes,
    raw_http,
    wait_until,
)

C = "/v1/completions"
PATIENCE_S = 60.0  # a hang guard, never a claim about speed
CHAT = "/v1/chat/completions"


def comp(**fields: object) -> dict[str, object]:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **fields}


def assert_openai_error(status: int, body: bytes, expected: int, code: str | None = None) -> dict[str, object]:
    assert status == expected, body[:300]
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"] and len(error["message"]) <= 1000
    if code is not None:
        assert error["code"] == code, error
    return error


# ---- bodies and encodings ------------------------------------------------------------

RAW_BODIES = [
    ("int-5000-digits", b'{"model": "demo", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("nesting-100000", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("nesting-500", b'{"prompt": "x", "user_data": ' + b"[" * 500 + b"]" * 500 + b"}"),
    ("lone-surrogate-prompt", b'{"model": "demo", "prompt": "abc \\ud800 def", "max_tokens": 2}'),
    ("lone-surrogate-list", b'{"model": "demo", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
    ("invalid-utf8", b'{"model": "demo", "prompt": "\xff\xfe", "max_tokens": 2}'),
    ("nan-literal", b'{"model": "demo", "prompt": "x", "temperature": NaN}'),
    ("truncated", b'{"model": "demo", "prompt": "x"'),
    ("empty", b""),
]


@pytest.mark.parametrize("body", [b for _, b in RAW_BODIES], ids=[n for n, _ in RAW_BODIES])
def test_malformed_bodies_are_400(big_body_server: LiveServer, body: bytes) -> None:
    reply = raw_http(big_body_server.port, post_bytes(C, body))
    assert_openai_error(reply.status, reply.body, 400)


def test_lone_surrogate_is_400_on_both_endpoints(server: LiveServer) -> None:
    chat = b'{"model": "demo", "messages": [{"role": "user", "content": "\\ud83d"}]}'
    for path, body in ((C, RAW_BODIES[3][1]), (CHAT, chat)):
        reply = raw_http(server.port, post_bytes(path, body))
        assert_openai_error(reply.status, reply.body, 400)


@pytest.mark.parametrize("encoding,payload", [
    ("gzip", b'{"prompt": "not gzip at all"}'),
    ("gzip", gzip.compress(b'{"prompt": "x"')[:-4]),
    ("deflate", b"\x00\x01garbage"),
    ("br", b"\x00\x01garbage"),
], ids=["gzip-plain", "gzip-truncated", "deflate-garbage", "br-garbage"])
def test_bad_content_encoding_is_400(server: LiveServer, encoding: str, payload: bytes) -> None:
    reply = raw_http(server.port, post_bytes(C, payload, f"Content-Encoding: {encoding}\r\n".encode()))
    assert_openai_error(reply.status, reply.body, 400)


def test_good_gzip_body_works(server: LiveServer) -> None:
    payload = gzip.compress(json.dumps(comp()).encode())
    reply = raw_http(server.port, post_bytes(C, payload, b"Content-Encoding: gzip\r\n"))
    assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] >= 1


def test_errors_never_echo_megabytes(big_body_server: LiveServer) -> None:
    huge = "z" * 2_000_000
    for body in (comp(model=[huge]), comp(stop=[huge]), comp(user=[huge]), comp(prompt=[[1, 2], huge]),
                 comp(max_tokens=int("9" * 4000))):
        reply = http("POST", big_body_server.url + C, body)
        error = assert_openai_error(reply.status, reply.text.encode(), 400)
        assert "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz" not in error["message"]


# ---- parameters the loaded model cannot run -------------------------------------------

ENGINE_POISON = [
    ("stop-id-past-vocab-min-tokens", comp(min_tokens=1, max_tokens=4, stop_token_ids=[10**6]), "stop_token_ids"),
    ("stop-id-at-vocab", comp(stop_token_ids=[1024]), "stop_token_ids"),
    ("top-k-2-64", comp(top_k=2**64, temperature=1.0), "top_k"),
    ("seed-2-64", comp(seed=2**64, temperature=1.0), "seed"),
    ("seed-below-int64", comp(seed=-(2**63) - 1, temperature=1.0), "seed"),
    ("stop-ids-too-many", comp(stop_token_ids=list(range(300))), "stop_token_ids"),
    ("stop-string-too-long", comp(stop=["s" * 300]), "stop"),
    ("prompt-id-past-vocab", comp(prompt=[1, 2, 5000]), "prompt"),
    ("prompts-times-n-never-fit", comp(prompt=["a"] * 64, n=2), "n"),
    ("priority-huge", comp(priority=2**70), "priority"),
]


@pytest.mark.parametrize("body,param", [c[1:] for c in ENGINE_POISON], ids=[c[0] for c in ENGINE_POISON])
def test_engine_poison_is_refused_before_the_engine(server: LiveServer, body: dict, param: str) -> None:
    before = metrics(server.url).get(f'inflight:request_rejected_total{{model_name="{MODEL_NAME}",reason="invalid_request"}}', 0)
    reply = http("POST", server.url + C, body)
    error = assert_openai_error(reply.status, reply.text.encode(), 400)
    assert error["param"] == param
    after = metrics(server.url)[f'inflight:request_rejected_total{{model_name="{MODEL_NAME}",reason="invalid_request"}}']
    assert after == before + 1
    assert http("POST", server.url + C, comp(temperature=0)).status == 200  # the server is fine


def test_extreme_valid_values_are_served(server: LiveServer) -> None:
    for body in (comp(top_k=2**31 - 1, temperature=1.0), comp(seed=2**64 - 1, temperature=1.0),
                 comp(seed=-(2**63), temperature=1.0), comp(min_tokens=2, max_tokens=3, stop_token_ids=[1023])):
        reply = http("POST", server.url + C, body)
        assert reply.status == 200, reply.text


# ---- headers and the HTTP parser --------------------------------------------------------

def test_non_ascii_authorization_is_401(keyed_server: LiveServer) -> None:
    for value in (b"Bearer \xff\xfe\xfd", "Bearer clé".encode(), b"Bearer " + API_KEY.encode() + b"\xc3\xa9"):
        reply = raw_http(keyed_server.port, post_bytes(C, json.dumps(comp()).encode(), b"Authorization: " + value + b"\r\n"))
        assert_openai_error(reply.status, reply.body, 401, "invalid_api_key")


def test_parser_errors_are_shaped_and_never_echo_the_key(keyed_server: LiveServer, caplog) -> None:
    secret = "sk-supersecret-abc123"
    bad_lines = [
        f"Authorization: Bearer {secret}\x01x\r\n".encode(),
        f"Authorization Bearer {secret}\r\n".encode(),
        f"Content-Length: {secret}\r\n".encode(),
    ]
    caplog.set_level(logging.DEBUG)
    for line in bad_lines:
        request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + line + b"\r\n"
        reply = raw_http(keyed_server.port, request)
        error = assert_openai_error(reply.status, reply.body, 400, "bad_http_request")
        assert secret not in error["message"] and secret not in reply.head
    reply = raw_http(keyed_server.port, b"GARBAGE\r\n\r\n")
    assert_openai_error(reply.status, reply.body, 400, "bad_http_request")
    logged = "\n".join(r.getMessage() + str(r.exc_info) + str(r.exc_text) for r in caplog.records)
    assert secret not in logged
    assert "malformed HTTP request" in logged


# ---- connection-level bounds -----------------------------------------------------------

@pytest.fixture(scope="module")
def big_body_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(demo_model_dir, EngineConfig(max_num_sequences=2, num_kv_blocks=32, max_model_len=256),
                      ServerSettings(model_name=MODEL_NAME, max_body_bytes=8 * 1024 * 1024)).start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def impatient_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(demo_model_dir, EngineConfig(max_num_sequences=2, num_kv_blocks=32, max_model_len=256),
                      ServerSettings(model_name=MODEL_NAME, keepalive_timeout_s=0.5,
                                     request_read_timeout_s=0.5)).start()
    yield live
    live.stop()


def test_half_sent_request_head_is_dropped(impatient_server: LiveServer) -> None:
    # The client never finishes nor closes: a reply at all (raw_http raises on its own timeout,
    # a hang guard) is the server dropping the connection after its 0.5 s read timeout.
    reply = raw_http(impatient_server.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
                     timeout=PATIENCE_S)
    assert reply.status == 0


def test_idle_keepalive_connection_is_closed(impatient_server: LiveServer) -> None:
    # The client keeps the connection open: reaching EOF (recv raises on the socket's timeout,
    # a hang guard) is the server closing it after its 0.5 s keep-alive timeout.
    with socket.create_connection(("127.0.0.1", impatient_server.port), timeout=PATIENCE_S) as sock:
        body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
        sock.sendall(f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        assert data.startswith(b"HTTP/1.1 200")


def test_slow_body_is_408(impatient_server: LiveServer) -> None:
    head = f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    reply = raw_http(impatient_server.port, head.encode() + b'{"prompt": ', timeout=10)
    assert_openai_error(reply.status, reply.body, 408, "request_timeout")


def test_client_disconnect_counts_as_abort(server: LiveServer) -> None:
    key = f'inflight:request_success_total{{finished_reason="abort",model_name="{MODEL_NAME}"}}'
    before = metrics(server.url).get(key, 0)
    body = json.dumps(comp(max_tokens=300, ignore_eos=True, stream=True, n=2)).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(post_bytes(C, body))
        assert sock.recv(100).startswith(b"HTTP/1.1 200")
    assert wait_until(lambda: metrics(server.url).get(key, 0) == before + 2, 20)
    assert wait_until(lambda: is_idle(server.url), 20)
