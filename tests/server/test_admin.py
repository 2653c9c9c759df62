"""The admin endpoint: it reports the live EngineConfig, changes max_num_sequences /
max_num_tokens / max_queue_len of the running engine (the scheduler obeys at once), and
needs its own admin key: the inference key does not grant it, and without an admin key
/admin is off."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.state import STATE
from tests.server.server_helpers import ADMIN_AUTH, ADMIN_KEY, API_KEY, MODEL_NAME, LiveServer, burst, http, metrics

AUTH = ADMIN_AUTH
INFERENCE_AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_get_reports_every_engine_field(keyed_server: LiveServer) -> None:
    reply = http("GET", f"{keyed_server.url}/admin/config", headers=AUTH)
    assert reply.status == 200
    config = reply.json()
    assert set(config) == {f.name for f in dataclasses.fields(EngineConfig)} | {"resolved"}
    assert config["max_num_sequences"] == 4 and config["num_kv_blocks"] == 64
    assert config["resolved"] == {"device": "cpu", "dtype": "float32", "kernel_backend": "cpu-native",
                                  "quantization": "none"}


def test_post_unknown_field_is_named_unknown(keyed_server: LiveServer) -> None:
    reply = http("POST", f"{keyed_server.url}/admin/config", {"max_num_seqs": 2}, AUTH)
    assert reply.status == 400 and reply.json()["error"]["param"] == "max_num_seqs"
    assert reply.json()["error"]["message"].startswith("unknown field 'max_num_seqs'")
    reply = http("POST", f"{keyed_server.url}/admin/config", {"block_size": 32}, AUTH)
    assert reply.status == 400 and "cannot be changed while running" in reply.json()["error"]["message"]


@pytest.fixture(scope="module")
def slow_keyed_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    """``keyed_server`` with every step slowed by an injected fault: a burst stays in flight
    long enough for /metrics to see it, however fast the engine is."""
    live = LiveServer(demo_model_dir, EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=256),
                      ServerSettings(model_name=MODEL_NAME, api_key=API_KEY, admin_api_key=ADMIN_KEY),
                      fault="slow-steps:20").start()
    yield live
    live.stop()


def test_post_changes_the_running_engine(slow_keyed_server: LiveServer) -> None:
    url = slow_keyed_server.url
    reply = http("POST", f"{url}/admin/config", {"max_num_sequences": 2, "max_queue_len": 10}, AUTH)
    try:
        assert reply.status == 200, reply.text
        assert reply.json()["max_num_sequences"] == 2 and reply.json()["max_queue_len"] == 10
        assert http("GET", f"{url}/admin/config", headers=AUTH).json()["max_num_sequences"] == 2
        assert metrics(url, INFERENCE_AUTH)[f'inflight:max_num_sequences{{model_name="{MODEL_NAME}"}}'] == 2
        _, samples = asyncio.run(asyncio.wait_for(burst(url, 6, 24, headers=INFERENCE_AUTH), 60))
        running = [s[f'inflight:num_requests_running{{model_name="{MODEL_NAME}"}}'] for s in samples]
        assert max(running) == 2
    finally:
        http("POST", f"{url}/admin/config", {"max_num_sequences": 4, "max_queue_len": 1024}, AUTH)


def test_post_empty_object_is_a_no_op_and_tokens_live(keyed_server: LiveServer) -> None:
    url = keyed_server.url
    before = http("GET", f"{url}/admin/config", headers=AUTH).json()
    assert http("POST", f"{url}/admin/config", {}, AUTH).json() == before
    changed = http("POST", f"{url}/admin/config", {"max_num_tokens": 256}, AUTH).json()
    assert changed == before | {"max_num_tokens": 256}
    http("POST", f"{url}/admin/config", {"max_num_tokens": before["max_num_tokens"]}, AUTH)


def test_admin_needs_the_admin_key(keyed_server: LiveServer) -> None:
    for headers in ({}, INFERENCE_AUTH, {"Authorization": "Bearer wrong"}):
        for method, body in (("GET", None), ("POST", {"max_queue_len": 0})):
            reply = http(method, f"{keyed_server.url}/admin/config", body, headers)
            assert reply.status == 401 and reply.json()["error"]["code"] == "invalid_admin_key"
    assert http("GET", f"{keyed_server.url}/admin/config", headers=AUTH).json()["max_queue_len"] == 1024
    # the admin key is not an inference key either
    reply = http("POST", f"{keyed_server.url}/v1/completions", {"prompt": "x", "max_tokens": 1}, AUTH)
    assert reply.status == 401


def test_admin_is_off_without_an_admin_key(demo_model_dir) -> None:
    from inflight.runtime.server import ServerSettings

    live = LiveServer(demo_model_dir, EngineConfig(max_num_sequences=2, num_kv_blocks=16, max_model_len=64),
                      ServerSettings(model_name=MODEL_NAME, api_key=API_KEY)).start()
    try:
        for headers in ({}, INFERENCE_AUTH):
            reply = http("POST", f"{live.url}/admin/config", {"max_queue_len": 0}, headers)
            assert reply.status == 404 and reply.json()["error"]["code"] == "admin_disabled"
            assert "--admin-api-key" in reply.json()["error"]["message"]
        assert live.app[STATE].engine.engine.config.max_queue_len == 1024
    finally:
        live.stop()


def test_a_retune_that_would_strand_prompts_is_refused(demo_model_dir) -> None:
    from inflight.runtime.server import ServerSettings

    config = EngineConfig(max_num_sequences=2, num_kv_blocks=32, max_model_len=128, max_num_tokens=128,
                          enable_chunked_context=False)
    live = LiveServer(demo_model_dir, config,
                      ServerSettings(model_name=MODEL_NAME, admin_api_key="k" * 8)).start()
    try:
        auth = {"Authorization": "Bearer " + "k" * 8}
        reply = http("POST", f"{live.url}/admin/config", {"max_num_tokens": 64}, auth)
        assert reply.status == 400 and reply.json()["error"]["param"] == "max_num_tokens"
        assert "chunked context is off" in reply.json()["error"]["message"]
        reply = http("POST", f"{live.url}/v1/completions", {"prompt": [1] * 120, "max_tokens": 4})
        assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] <= 4
    finally:
        live.stop()
