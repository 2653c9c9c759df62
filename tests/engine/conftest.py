"""The engine tests' seeded demo models (tests/runtime/conftest.py)."""

from tests.runtime.conftest import llama_dir, model_factory  # noqa: F401 - fixtures
