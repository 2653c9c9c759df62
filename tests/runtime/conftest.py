"""Fixtures for engine tests: small seeded demo models, made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.runtime.demo.model import make_demo_model


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory: pytest.TempPathFactory):
    made: dict[tuple[str, str, int], Path] = {}

    def make(arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
        key = (arch, size, seed)
        if key not in made:
            made[key] = make_demo_model(tmp_path_factory.mktemp(f"{arch}-{size}-{seed}"), arch, size, seed)
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(model_factory) -> Path:
    return model_factory("llama")
