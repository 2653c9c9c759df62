"""Shared helpers of the Helm chart tests (a module with a unique name, so that test modules
import it safely beside other test folders' conftest.py): paths, the values cases, parsing
rendered manifests, and the metric names the contract lists."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


# What the chart ships for the endpoint pickers, not for the operator: the pickers' ClusterRole
# (bound per model by the operator), their TokenReview/SubjectAccessReview rights for /metrics, and
# the ServiceAccount whose token Prometheus presents to them (tests/chart/test_chart_picker_metrics.py).
PICKER_SUFFIXES = ("-epp", "-epp-auth", "-epp-metrics-reader")


def is_for_pickers(obj: dict[str, Any]) -> bool:
    return obj["kind"] in ("ClusterRole", "ClusterRoleBinding", "ServiceAccount", "Secret") and \
        obj["metadata"]["name"].endswith(PICKER_SUFFIXES)


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one object of ``kind`` that is the operator's (what is shipped for the pickers left out)."""
    found = [o for o in by_kind(objs, kind) if not is_for_pickers(o)]
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


METRIC = re.compile(r"inflight:[a-z_:]+")


def contract_metrics() -> set[str]:
    """Every `inflight:*` metric name that docs/CONTRACTS.md lists."""
    text = (REPO / "docs" / "CONTRACTS.md").read_text()
    names = set(METRIC.findall(text))
    assert len(names) >= 15, f"could not read the metric list from CONTRACTS.md: {names}"
    return names
