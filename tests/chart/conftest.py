"""Fixtures for the Helm chart tests: load, lint and render charts/inflight with Helm's own
library (helm-python-sdk), offline. Knows nothing about the operator's code beyond its
declared RBAC needs, which the RBAC test imports itself."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "inflight"
HERE = Path(__file__).resolve().parent
RELEASE = "inflight"
RELEASE_NAMESPACE = "inflight-system"
WATCH_NAMESPACE = "llm-serving"

# Each values case: a name and the values files layered on the chart's defaults, in order.
VALUES_CASES = {
    "defaults": [],
    "all-on": ["values-all-on.yaml"],
    "namespaced": ["values-namespaced.yaml"],
    "all-on-namespaced": ["values-all-on.yaml", "values-namespaced.yaml"],
}


def load_values(case: str) -> dict[str, Any]:
    """The user-supplied values of a case (later files override earlier ones)."""
    merged: dict[str, Any] = {}
    for name in VALUES_CASES[case]:
        _deep_merge(merged, yaml.safe_load((HERE / name).read_text()) or {})
    return merged


def _deep_merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def parse_manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every object in the rendered templates (NOTES.txt and empty documents dropped)."""
    objects = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects.append(doc)
    return objects


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


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]
