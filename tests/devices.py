"""Which device a test runs on: CPU always, CUDA as a ``gpu``-marked parameter.

CPU tests pin ``device="cpu"`` (with CUDA present ``auto`` would mean CUDA and bf16, and a
float32 token-exact comparison would fail for the wrong reason). A test that should also
prove itself on a GPU takes ``device`` from :func:`on_devices`; the ``gpu`` marker makes a
CPU machine skip that case and lets ``make gpu-check`` select it with ``-m gpu``.
"""

from __future__ import annotations

import pytest


def on_devices(*names: str) -> list[object]:
    """``pytest.mark.parametrize`` values for ``names``; ``cuda`` carries the ``gpu`` marker."""
    return [
        pytest.param(n, marks=pytest.mark.gpu, id=n) if n == "cuda" else pytest.param(n, id=n)
        for n in names
    ]
