"""The access log (one line per HTTP request, refused ones included, never a body, a key or a
query string; off with --no-access-log), the Ctrl-C line and the second Ctrl-C, and a
--chat-template served by a live server."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from inflight.runtime.cli.serving_dir import serving_dir
from inflight.runtime.config import EngineConfig
from inflight.runtime.logs import ACCESS_LOGGER, AccessLog, JsonFormatter
from inflight.runtime.server import ServerSettings, create_app
from inflight.runtime.server.state import STATE
from tests.server.server_helpers import MODEL_NAME, LiveServer, http

KEY = "sekrit-key-1"
serve = importlib.import_module("inflight.runtime.server.serve")  # the module (the package exports the function)


async def _requests(access_log: AccessLog) -> None:
    """Requests a loading server refuses or answers, against an app with ``access_log``."""
    release = threading.Event()

    def loader() -> object:
        release.wait(10)
        raise RuntimeError("no weights here")

    app = create_app(ServerSettings(model_name=MODEL_NAME, api_key=KEY), loader, access_log)  # type: ignore[arg-type]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for method, path, headers, body in [
                ("GET", "/health", {}, None),
                ("GET", "/ready", {}, None),
                ("GET", "/no/such/route?token=query-secret", {}, None),
                ("DELETE", "/health", {}, None),
                ("POST", "/v1/completions", {"Authorization": "Bearer wrong-key"}, {"prompt": "body-secret"}),
                ("POST", "/v1/completions", {"Authorization": f"Bearer {KEY}", "X-Request-Id": "req-42"},
                 {"model": MODEL_NAME, "prompt": "body-secret"}),
            ]:
                async with session.request(method, url + path, headers=headers, json=body) as resp:
                    await resp.read()
        release.set()
        with pytest.raises(RuntimeError, match="no weights"):
            await asyncio.wait_for(app[STATE].engine.wait_ready(), 10)
    finally:
        await runner.cleanup()


def test_every_request_gets_one_access_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    asyncio.run(_requests(AccessLog(exclude=frozenset({"/ready"}))))
    records = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    lines = [r.getMessage() for r in records]
    assert [line.rsplit(" ", 2)[0] for line in lines[:4]] == [
        "GET /health 200", "GET /no/such/route 404", "DELETE /health 405", "POST /v1/completions 401"]
    assert lines[4].startswith("POST /v1/completions 503 ") and lines[4].endswith(" ms request_id=req-42")
    assert len(lines) == 5  # /ready is excluded
    fields = json.loads(JsonFormatter().format(records[4]))
    assert (fields["event"], fields["method"], fields["path"], fields["status"]) == (
        "http_request", "POST", "/v1/completions", 503)
    assert fields["request_id"] == "req-42" and isinstance(fields["latency_ms"], float)
    logged = " ".join(lines) + json.dumps([json.loads(JsonFormatter().format(r)) for r in records])
    for secret in (KEY, "wrong-key", "body-secret", "query-secret"):
        assert secret not in logged


def test_no_access_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    asyncio.run(_requests(AccessLog(enabled=False)))
    assert [r for r in caplog.records if r.name == ACCESS_LOGGER] == []


def test_first_ctrl_c_drains_with_a_line_and_the_second_exits_now(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    exits: list[tuple[int, str]] = []
    monkeypatch.setattr(serve, "_exit_now", lambda code, message, peers: exits.append((code, message)))
    app = {STATE: SimpleNamespace(settings=SimpleNamespace(drain_timeout_s=12.0), engine=None)}
    stop = asyncio.Event()
    peers = serve.FrontEndGroup(1)  # one front end: nothing to forward the signal to
    with caplog.at_level(logging.WARNING, logger="inflight.server"):
        serve._on_signal(signal.SIGINT, stop, app, peers, False)  # type: ignore[arg-type]
        assert stop.is_set() and exits == []
        serve._on_signal(signal.SIGINT, stop, app, peers, False)  # type: ignore[arg-type]
    assert "SIGINT: draining (up to 12 s); press Ctrl-C again to exit now" in caplog.text
    assert exits == [(128 + signal.SIGINT, "second SIGINT: exiting at once without draining")]


def test_the_server_applies_the_given_chat_template(demo_model_dir: Path, tmp_path: Path) -> None:
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    served = serving_dir(demo_model_dir, None, template, root=tmp_path)
    live = LiveServer(served, EngineConfig(max_num_sequences=2, num_kv_blocks=16, max_model_len=128),
                      ServerSettings(model_name=MODEL_NAME)).start()
    try:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
        tokens = http("POST", f"{live.url}/tokenize", body).json()["tokens"]
        assert live.app[STATE].engine.engine.tokenizer.decode(tokens, skip_special_tokens=True) == "<<hi>>"
    finally:
        live.stop()
