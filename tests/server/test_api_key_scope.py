"""With --api-key set, every route that runs the tokenizer, the template or the model needs it
(/v1/*, /tokenize, /detokenize), and a client without it is refused before it sends a body
(``Expect: 100-continue`` gets the 401, not a 100); probes stay open, and /metrics answers to
the server's keys."""

from __future__ import annotations

import socket

import pytest

from tests.server.server_helpers import ADMIN_KEY, API_KEY, MODEL_NAME, LiveServer, http

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOKENIZE = {"model": MODEL_NAME, "prompt": "hello"}


@pytest.mark.parametrize(("path", "body"), [("/tokenize", TOKENIZE),
                                            ("/detokenize", {"model": MODEL_NAME, "tokens": [5, 6]})])  # fmt: skip
def test_tokenizer_routes_need_the_key(keyed_server: LiveServer, path: str, body: dict) -> None:
    refused = http("POST", keyed_server.url + path, body)
    assert refused.status == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert http("POST", keyed_server.url + path, body, {"Authorization": "Bearer wrong"}).status == 401
    assert http("POST", keyed_server.url + path, body, AUTH).status == 200


@pytest.mark.parametrize("path", ["/health", "/ready", "/version"])
def test_probes_stay_open(keyed_server: LiveServer, path: str) -> None:
    assert http("GET", keyed_server.url + path).status == 200


def test_metrics_answer_to_the_servers_keys(keyed_server: LiveServer) -> None:
    assert http("GET", keyed_server.url + "/metrics").status == 401
    assert http("GET", keyed_server.url + "/metrics", headers={"Authorization": "Bearer wrong"}).status == 401
    for key in (API_KEY, ADMIN_KEY):
        assert http("GET", keyed_server.url + "/metrics", headers={"Authorization": f"Bearer {key}"}).status == 200


def _expect_continue(port: int, path: str, auth: bytes) -> bytes:
    """Send headers announcing a body with Expect: 100-continue, and no body: the first reply."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: 100000\r\nExpect: 100-continue\r\n").encode() + auth + b"\r\n"  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        return sock.recv(4096)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_expect_continue_is_refused_without_the_key(keyed_server: LiveServer, path: str) -> None:
    refused = _expect_continue(keyed_server.port, path, b"")
    assert refused.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in refused
    accepted = _expect_continue(keyed_server.port, path, f"Authorization: Bearer {API_KEY}\r\n".encode())
    assert accepted.startswith(b"HTTP/1.1 100 Continue")
