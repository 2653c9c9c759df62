"""Fixtures for the structured-output / tools / reasoning / echo tests: tiny random llama and
qwen3 demo models (each with its family's chat template) served in-process on 127.0.0.1, and
official ``openai`` clients pointed at them (the suite's one harness,
:class:`tests.server.server_helpers.LiveServer`). Engines stay small so the directory runs in a few
minutes on a 2-core machine."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from tests.server.server_helpers import MODEL_NAME, LiveServer

CONFIG = dict(max_num_sequences=8, num_kv_blocks=512, max_model_len=1024, max_queue_len=256)


def _serve(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Iterator[LiveServer]:
    from inflight.runtime.demo.model import make_demo_model

    model_dir = make_demo_model(tmp_path_factory.mktemp(f"structured-{arch}") / arch, arch=arch, size="tiny")
    live = LiveServer(model_dir, EngineConfig(**CONFIG), ServerSettings(model_name=MODEL_NAME)).start()
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
