"""Fixtures for the structured-output / tools / reasoning / echo tests: tiny random llama and
qwen3 demo models (each with its family's chat template) served in-process on 127.0.0.1, and
official ``openai`` clients pointed at them. Engines stay small so the directory runs in a few
minutes on a 2-core machine."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings, create_app
from inflight.runtime.server.state import STATE

MODEL_NAME = "demo"
CONFIG = dict(max_num_sequences=8, num_kv_blocks=512, max_model_len=1024, max_queue_len=256)


class LiveServer:
    """``create_app`` on an ephemeral 127.0.0.1 port, in a background event-loop thread."""

    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        self.model_dir, self.config = model_dir, config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="structured-test-server", daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    def start(self) -> LiveServer:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(180)
        return self

    async def _start(self) -> None:
        from inflight.runtime.engine import LLMEngine

        app = create_app(ServerSettings(model_name=MODEL_NAME),
                         lambda: LLMEngine.from_model_dir(self.model_dir, self.config))
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        await app[STATE].engine.wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):  # noqa: ANN201 - the LLMEngine, for white-box checks
        assert self.runner is not None
        return self.runner.app[STATE].engine.engine

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def _serve(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Iterator[LiveServer]:
    from inflight.runtime.demo_model import make_demo_model

    model_dir = make_demo_model(tmp_path_factory.mktemp(f"structured-{arch}") / arch, arch=arch, size="tiny")
    live = LiveServer(model_dir, EngineConfig(**CONFIG)).start()
    yield live
    live.stop()


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from _serve(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def qwen3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from _serve(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def mistral_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from _serve(tmp_path_factory, "mistral")


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def any_server(request: pytest.FixtureRequest) -> LiveServer:
    return request.getfixturevalue(f"{request.param}_server")


def client_for(server: LiveServer):  # noqa: ANN201
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
