"""``--priority-floor``: under the ``priority`` policy only the trusted caller (``--priority-api-key``,
a second inference key) may ask for a priority more urgent than the floor; anyone else gets a
400 naming ``priority`` (refused, never silently clamped). The admin key stays off /v1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from tests.server.server_helpers import ADMIN_AUTH, ADMIN_KEY, API_KEY, MODEL_NAME, LiveServer, http

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PRIORITY_KEY = "priority-key-789"
TRUSTED_AUTH = {"Authorization": f"Bearer {PRIORITY_KEY}"}
FLOOR = 0


@pytest.fixture(scope="module")
def floored_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(
        demo_model_dir,
        EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=256, scheduler_policy="priority"),
        ServerSettings(model_name=MODEL_NAME, api_key=API_KEY, admin_api_key=ADMIN_KEY, priority_floor=FLOOR,
                       priority_api_key=PRIORITY_KEY),
    ).start()
    yield live
    live.stop()


def _body(path: str, priority: int) -> dict:
    if path == "/v1/completions":
        return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, "priority": priority}
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "priority": priority}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_priority_above_the_floor_is_refused_without_the_admin_key(floored_server: LiveServer, path: str) -> None:
    refused = http("POST", floored_server.url + path, _body(path, FLOOR - 1), AUTH)
    assert refused.status == 400
    error = refused.json()["error"]
    assert error["param"] == "priority" and error["code"] == "priority_not_allowed"
    assert "--priority-floor" in error["message"] and "--priority-api-key" in error["message"]
    for allowed in (FLOOR, FLOOR + 5):
        assert http("POST", floored_server.url + path, _body(path, allowed), AUTH).status == 200
    assert http("POST", floored_server.url + path, _body(path, FLOOR - 1), ADMIN_AUTH).status == 401


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_priority_key_may_ask_for_any_priority(floored_server: LiveServer, path: str) -> None:
    reply = http("POST", floored_server.url + path, _body(path, -(2**31)), TRUSTED_AUTH)
    assert reply.status == 200, reply.text
    assert reply.json()["choices"]


def test_the_priority_key_is_an_inference_key_only(floored_server: LiveServer) -> None:
    body = _body("/v1/completions", FLOOR)
    assert http("POST", floored_server.url + "/v1/completions", body).status == 401
    assert http("POST", floored_server.url + "/v1/completions", body, {"Authorization": "Bearer no"}).status == 401
    assert http("POST", floored_server.url + "/tokenize", {"prompt": "hi"}, TRUSTED_AUTH).status == 200
    assert http("GET", floored_server.url + "/admin/config", None, TRUSTED_AUTH).status == 401  # not admin


def test_the_flag() -> None:
    from inflight.runtime.cli.command import build_parser, server_settings_from_args

    def settings(*argv: str) -> ServerSettings:
        return server_settings_from_args(build_parser().parse_args(["serve", "--model", "m", *argv]))

    assert settings().priority_floor is None and settings().priority_api_key is None
    chosen = settings("--priority-floor", "-3", "--priority-api-key", "p")
    assert (chosen.priority_floor, chosen.priority_api_key) == (-3, "p")
    with pytest.raises(ValueError, match="must differ"):
        ServerSettings(model_name="m", api_key="same", priority_api_key="same")
