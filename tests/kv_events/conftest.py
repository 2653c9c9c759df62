"""Fixtures from the engine and server tests: seeded demo models (made once per session)."""

from tests.runtime.conftest import llama_dir, model_factory  # noqa: F401 - fixtures
from tests.server.conftest import demo_model_dir  # noqa: F401 - fixture
