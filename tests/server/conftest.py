"""Fixtures for server tests: one tiny demo model per session and in-process live servers.

Engines stay small (a few KV blocks, small batches) so the whole directory runs in a few
minutes on a 2-core machine. Servers bind 127.0.0.1 on ephemeral ports.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from tests.server.server_helpers import ADMIN_KEY, API_KEY, MAIN_CONFIG, MODEL_NAME, LiveServer


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("server-model") / "demo", size="tiny")


@pytest.fixture(scope="session")
def server(demo_model_dir: Path) -> Iterator[LiveServer]:
    """The shared server: no API key, an admin key, max 4 sequences, 128 KV blocks, 64 KiB body limit."""
    live = LiveServer(
        demo_model_dir,
        EngineConfig(**MAIN_CONFIG),
        ServerSettings(model_name=MODEL_NAME, max_body_bytes=64 * 1024, admin_api_key=ADMIN_KEY),
    ).start()
    yield live
    live.stop()


@pytest.fixture(scope="session")
def keyed_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    """A server that requires ``Authorization: Bearer test-key-123`` (and the admin key on /admin)."""
    live = LiveServer(
        demo_model_dir,
        EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=256),
        ServerSettings(model_name=MODEL_NAME, api_key=API_KEY, admin_api_key=ADMIN_KEY),
    ).start()
    yield live
    live.stop()
