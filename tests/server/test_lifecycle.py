"""Server lifecycle in-process: 503 while loading (probes still answer), a failed load makes
``serve`` return exit code 1, and a drain that times out answers what is left (a stream error
event, a 503) and frees every KV block."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings, create_app, drain, serve
from inflight.runtime.server.state import STATE
from tests.server.server_helpers import MODEL_NAME, LiveServer, is_idle, stream_error_code, wait_until


async def _loading_scenario(loader: Callable[[], object], release: threading.Event) -> dict[str, object]:
    app = create_app(ServerSettings(model_name=MODEL_NAME, admin_api_key="admin"), loader)  # type: ignore[arg-type]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    seen: dict[str, object] = {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for path in ("/health", "/ready", "/metrics", "/admin/config"):
                async with session.get(url + path, headers={"Authorization": "Bearer admin"}) as resp:
                    seen[path] = resp.status
            body = {"model": MODEL_NAME, "prompt": "x"}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                seen["generate"] = (resp.status, resp.headers.get("Retry-After"),
                                    (await resp.json())["error"]["code"])
        release.set()
        with pytest.raises(RuntimeError, match="no weights"):
            await asyncio.wait_for(app[STATE].engine.wait_ready(), 10)
    finally:
        await runner.cleanup()
    return seen


def test_loading_answers_probes_and_refuses_generation() -> None:
    release = threading.Event()

    def loader() -> object:
        release.wait(10)
        raise RuntimeError("no weights here")

    seen = asyncio.run(_loading_scenario(loader, release))
    assert seen["/health"] == 200 and seen["/ready"] == 503 and seen["/metrics"] == 200
    assert seen["/admin/config"] == 503
    assert seen["generate"] == (503, "5", "loading")


def test_serve_returns_1_when_loading_fails() -> None:
    def loader() -> object:
        raise FileNotFoundError("config.json not found")

    settings = ServerSettings(model_name=MODEL_NAME)
    assert asyncio.run(asyncio.wait_for(serve(settings, loader, "127.0.0.1", 0), 30)) == 1  # type: ignore[arg-type]


async def _stream_until_cut(url: str, started: asyncio.Event) -> str:
    """How a long stream ended: "completed", "error:<code>" (an error event) or "silent-cut"."""
    body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
    error_code = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        try:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                async for raw in resp.content:
                    started.set()
                    error_code = stream_error_code(raw) or error_code
        except aiohttp.ClientError:
            return "silent-cut"
    return "completed" if error_code is None else f"error:{error_code}"


async def _plain_until_cut(url: str) -> tuple[int, str | None]:
    body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 400, "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            return resp.status, (await resp.json()).get("error", {}).get("code")


def test_drain_timeout_answers_the_rest_and_frees_blocks(demo_model_dir: Path) -> None:
    live = LiveServer(demo_model_dir, EngineConfig(max_num_sequences=2, num_kv_blocks=64, max_model_len=512),
                      ServerSettings(model_name=MODEL_NAME)).start()
    try:
        async def scenario() -> tuple[list[str], tuple[int, str | None], bool]:
            started = asyncio.Event()
            streams = [asyncio.create_task(_stream_until_cut(live.url, started)) for _ in range(3)]
            plain = asyncio.create_task(_plain_until_cut(live.url))
            await asyncio.wait_for(started.wait(), 30)
            for _ in range(500):  # all four admitted before the drain starts
                if live.app[STATE].num_in_flight == 4:
                    break
                await asyncio.sleep(0.01)
            drained = await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(drain(live.app, 0.2), live.loop))
            return list(await asyncio.gather(*streams)), await plain, drained

        outcomes, plain, drained = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert drained is False and "error:drain_timeout" in outcomes
        assert set(outcomes) <= {"completed", "error:drain_timeout"}  # never a silent close
        assert plain == (503, "drain_timeout")
        assert wait_until(lambda: is_idle(live.url), 10)
        assert live.app[STATE].num_in_flight == 0
    finally:
        live.stop()
