"""Shared test values for the operator tests: example manifests and a spec builder."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import yaml

from inflight.operator.spec import InferenceSpec, parse_spec

REPO = pathlib.Path(__file__).resolve().parents[2]
_ALL_EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# InferenceDeployments (what the CRD, the operator and the emulator take); the others are the
# Gateway API objects that route to them (examples/inference-pool-route.yaml): the emulator has
# no Gateway API kinds, so test_route_example checks those against what the operator renders.
EXAMPLES = [p for p in _ALL_EXAMPLES if yaml.safe_load(p.read_text()).get("kind") == "InferenceDeployment"]
ROUTE_EXAMPLES = [p for p in _ALL_EXAMPLES if p not in EXAMPLES]
CRD_PATH = REPO / "crds" / "inflight.dev_inferencedeployments.yaml"

MINIMAL_SPEC: dict[str, Any] = {"model": {"pvc": {"claimName": "models", "path": "m"}}}


def load_example(path: pathlib.Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def make_spec(overrides: dict[str, Any] | None = None, name: str = "demo", ns: str = "ns1") -> InferenceSpec:
    raw = copy.deepcopy(MINIMAL_SPEC)
    raw.update(copy.deepcopy(overrides or {}))
    return parse_spec(name, ns, raw)
