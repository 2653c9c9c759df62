"""The Gateway API route example (examples/inference-pool-route.yaml) routes to what the operator
renders: an HTTPRoute whose InferencePool backend is the pool rendered for an example
InferenceDeployment (same name, namespace and API group), under the runtime's /v1 prefix. The
emulator has no Gateway API kinds, so this is checked here rather than applied with kubectl; the
docs' Routing section shows the same route."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

from inflight.operator import render
from inflight.operator.render import Owner
from inflight.operator.spec import parse_spec
from tests.operator.helpers import EXAMPLES, REPO, ROUTE_EXAMPLES, load_example


def _rendered_pools() -> dict[tuple[str, str], dict]:
    pools = {}
    for path in EXAMPLES:
        doc = load_example(path)
        spec = parse_spec(doc["metadata"]["name"], doc["metadata"]["namespace"], doc["spec"])
        for obj in render.render_pool_objects(spec, Owner(name=spec.name, uid="0b7c4e1e-0000-4000-8000-000000000002")):
            if obj["kind"] == "InferencePool":
                pools[(spec.namespace, obj["metadata"]["name"])] = obj
    return pools


def test_the_only_foreign_example_kind_is_a_route() -> None:
    """A new non-InferenceDeployment example needs a check of its own (the emulator cannot apply it)."""
    assert [p.name for p in ROUTE_EXAMPLES] == ["inference-pool-route.yaml"]
    assert [yaml.safe_load(p.read_text())["kind"] for p in ROUTE_EXAMPLES] == ["HTTPRoute"]


@pytest.mark.parametrize("path", ROUTE_EXAMPLES, ids=lambda p: p.name)
def test_route_sends_v1_to_a_rendered_inference_pool(path: pathlib.Path) -> None:
    route = yaml.safe_load(path.read_text())
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    pools = _rendered_pools()
    namespace = route["metadata"]["namespace"]
    assert route["spec"]["parentRefs"] and all(p["kind"] == "Gateway" for p in route["spec"]["parentRefs"])
    for rule in route["spec"]["rules"]:
        assert [m["path"] for m in rule["matches"]] == [{"type": "PathPrefix", "value": "/v1"}]
        for ref in rule["backendRefs"]:
            pool = pools.get((ref.get("namespace", namespace), ref["name"]))
            assert pool is not None, f"{ref['name']}: no example renders that InferencePool"
            assert (ref["group"], ref["kind"]) == (pool["apiVersion"].split("/")[0], pool["kind"])
            assert "port" not in ref  # an InferencePool backend takes the pool's targetPorts


def test_kubernetes_doc_shows_the_route_example() -> None:
    """docs/kubernetes.md's Routing section shows the example as it is (no second copy to drift)."""
    text = (REPO / "docs" / "kubernetes.md").read_text()
    routing = text.split("### Routing", 1)[1].split("\n## ", 1)[0]
    shown = [d for b in re.findall(r"```yaml\n(.*?)```", routing, re.S) for d in yaml.safe_load_all(b)
             if isinstance(d, dict) and d.get("kind") == "HTTPRoute"]
    assert shown == [yaml.safe_load(p.read_text()) for p in ROUTE_EXAMPLES]
