"""Chart values that must reach where they act: the runtime and picker images reach the
operator (which defaults spec.image from them), and NetworkPolicies land in the namespaces
where runtime pods run, never only in the release's in cluster mode."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from chart_support import RELEASE, RELEASE_NAMESPACE, by_kind, load_values, parse_manifests


def test_chart_images_reach_the_operator(chart: helm.Chart) -> None:
    values = {**load_values("defaults"), "runtimeImage": {"repository": "registry.local/inflight-runtime", "tag": "9.9"},
              "pickerImage": {"repository": "registry.local/epp", "tag": "v2"}}
    objs = parse_manifests(chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE, is_install=True))
    (operator,) = [d for d in by_kind(objs, "Deployment")]
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["INFLIGHT_OPERATOR_RUNTIME_IMAGE"] == "registry.local/inflight-runtime:9.9"
    assert env["INFLIGHT_OPERATOR_PICKER_IMAGE"] == "registry.local/epp:v2"
    from inflight.operator.spec import SpecDefaults, parse_spec

    defaults = SpecDefaults.from_env({k: v for k, v in env.items() if v is not None})
    spec = parse_spec("m", "ns", {"model": {"pvc": {"claimName": "models"}}, "inferencePool": {"enabled": True}},
                      defaults)
    assert spec.image == "registry.local/inflight-runtime:9.9"
    assert spec.inference_pool.picker_image == "registry.local/epp:v2"


def test_network_policies_land_where_the_runtime_pods_are(chart: helm.Chart) -> None:
    def policies(values: dict[str, Any]) -> list[str]:
        objs = parse_manifests(chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE, is_install=True))
        return [p["metadata"]["namespace"] for p in by_kind(objs, "NetworkPolicy")]

    assert policies({"networkPolicy": {"enabled": True}, "watchNamespace": "llm-serving"}) == ["llm-serving"]
    assert policies({"networkPolicy": {"enabled": True, "namespaces": ["a", "b"]}}) == ["a", "b"]
    with pytest.raises(Exception, match="networkPolicy.namespaces must list"):  # cluster mode, none listed
        policies({"networkPolicy": {"enabled": True}})
