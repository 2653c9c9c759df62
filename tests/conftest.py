"""Suite-wide test plumbing: the ``gpu`` marker and the device a test runs on.

Tests marked ``gpu`` need a CUDA device and are skipped (with the reason) where none is
visible, so ``make test`` on a CPU machine reports them instead of failing. On a GPU machine
``make gpu-check`` selects them with ``-m gpu``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check runs it on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """For tests that run a ``main`` which configures the root logger: put it back after."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    yield
    root.handlers[:], root.level = saved[0], saved[1]
