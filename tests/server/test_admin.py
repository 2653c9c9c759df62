"""The admin endpoint: it reports the live EngineConfig, changes max_num_sequences /
max_num_tokens / max_queue_len of the running engine (the scheduler obeys at once), and
needs the API key when one is set."""

from __future__ import annotations

import asyncio
import dataclasses

from conftest import API_KEY, MODEL_NAME
from server_helpers import LiveServer, burst, http, metrics

from inflight.runtime.config import EngineConfig

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_get_reports_every_engine_field(keyed_server: LiveServer) -> None:
    reply = http("GET", f"{keyed_server.url}/admin/config", headers=AUTH)
    assert reply.status == 200
    config = reply.json()
    assert set(config) == {f.name for f in dataclasses.fields(EngineConfig)} | {"resolved"}
    assert config["max_num_sequences"] == 4 and config["num_kv_blocks"] == 64
    assert config["resolved"] == {"device": "cpu", "dtype": "float32", "kernel_backend": "torch"}


def test_post_unknown_field_is_named_unknown(keyed_server: LiveServer) -> None:
    reply = http("POST", f"{keyed_server.url}/admin/config", {"max_num_seqs": 2}, AUTH)
    assert reply.status == 400 and reply.json()["error"]["param"] == "max_num_seqs"
    assert reply.json()["error"]["message"].startswith("unknown field 'max_num_seqs'")
    reply = http("POST", f"{keyed_server.url}/admin/config", {"block_size": 32}, AUTH)
    assert reply.status == 400 and "cannot be changed while running" in reply.json()["error"]["message"]


def test_post_changes_the_running_engine(keyed_server: LiveServer) -> None:
    url = keyed_server.url
    reply = http("POST", f"{url}/admin/config", {"max_num_sequences": 2, "max_queue_len": 10}, AUTH)
    try:
        assert reply.status == 200, reply.text
        assert reply.json()["max_num_sequences"] == 2 and reply.json()["max_queue_len"] == 10
        assert http("GET", f"{url}/admin/config", headers=AUTH).json()["max_num_sequences"] == 2
        assert metrics(url)[f'inflight:max_num_sequences{{model_name="{MODEL_NAME}"}}'] == 2
        _, samples = asyncio.run(asyncio.wait_for(burst(url, 6, 24, headers=AUTH), 60))
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


def test_admin_needs_the_key(keyed_server: LiveServer) -> None:
    for method, body in (("GET", None), ("POST", {"max_num_sequences": 1})):
        reply = http(method, f"{keyed_server.url}/admin/config", body)
        assert reply.status == 401 and reply.json()["error"]["type"] == "authentication_error"
    assert http("GET", f"{keyed_server.url}/admin/config", headers=AUTH).json()["max_num_sequences"] == 4
