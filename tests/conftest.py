"""Suite-wide test plumbing: the ``gpu`` marker, the ``unit`` marker (given by the rule in
:mod:`tests.kinds`; ``make test-fast`` runs ``-m unit``) and the device a test runs on.

Tests marked ``gpu`` need a CUDA device and are skipped (with the reason) where none is
visible, so ``make test`` on a CPU machine reports them instead of failing. On a GPU machine
``make gpu-check`` selects them with ``-m gpu``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests import kinds

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if unit_test_reason(item) is None:
            item.add_marker(pytest.mark.unit)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check runs it on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def unit_test_reason(item: pytest.Item) -> str | None:
    """Why ``item`` is not a pure unit test (:mod:`tests.kinds`), or None when it is."""
    module = getattr(item, "module", None)
    if module is None or "gpu" in item.keywords:
        return "not a Python test function" if module is None else "needs a GPU"
    info = getattr(item, "_fixtureinfo", None)
    fixture_files = sorted({Path(inspect.getfile(d.func)).resolve()
                            for defs in (info.name2fixturedefs.values() if info else ()) for d in defs})
    return kinds.item_heavy_reason(Path(module.__file__).resolve(), fixture_files)


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """For tests that run a ``main`` which configures the root logger: put it back after."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = saved[0], saved[1]
