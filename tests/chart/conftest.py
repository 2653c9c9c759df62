"""Fixtures for the Helm chart tests: load and render charts/inflight once per session with
Helm's own library (helm-python-sdk), offline. Helpers live in chart_support.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from chart_support import CHART_DIR, RELEASE, RELEASE_NAMESPACE, load_values, parse_manifests

helm = pytest.importorskip("helm_python")  # absent on a bare GPU machine (docs/gpu.md)


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart: helm.Chart) -> Callable[[str], dict[str, str]]:
    """render(case) -> {template path: rendered text}, as `helm install` would."""
    cache: dict[str, dict[str, str]] = {}

    def _render(case: str) -> dict[str, str]:
        if case not in cache:
            cache[case] = chart.render(
                load_values(case), name=RELEASE, namespace=RELEASE_NAMESPACE, is_install=True
            )
        return cache[case]

    return _render


@pytest.fixture(scope="session")
def objects(render: Callable[[str], dict[str, str]]) -> Callable[[str], list[dict[str, Any]]]:
    """objects(case) -> the rendered Kubernetes objects."""
    return lambda case: parse_manifests(render(case))
