"""The hostile suite's server: a tiny demo model served on 127.0.0.1 with its engine in an
engine-core process, as ``inflight serve`` runs it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.hostile.suite import hostile_engine_config, hostile_settings
from tests.server.server_helpers import LiveServer


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from inflight.runtime.demo.model import make_demo_model

    model_dir = make_demo_model(tmp_path_factory.mktemp("hostile-model") / "demo", size="tiny")
    live = LiveServer(model_dir, hostile_engine_config(), hostile_settings(), engine_process=True).start()
    yield live
    live.stop()
