"""The endpoint picker's rendered Deployment and Service, by table: HA pickers (``replicas`` > 1)
spread across nodes (a preferred pod anti-affinity on ``kubernetes.io/hostname`` selecting
exactly the picker's own pods); the picker's ``/metrics`` keeps its token check unless the
installation turns it off (``INFLIGHT_OPERATOR_PICKER_METRICS_AUTH=false`` ->
``--metrics-endpoint-auth=false``), and its Service exposes the metrics port for a scraper."""

from __future__ import annotations

from typing import Any

import pytest

from inflight.operator import render_pool
from inflight.operator.spec import SpecDefaults, parse_spec
from tests.operator.helpers import MINIMAL_SPEC, make_spec

META: dict[str, Any] = {"name": "demo-epp", "namespace": "ns1"}
AUTH_FLAG = "--metrics-endpoint-auth=false"


def _pool(replicas: int, image: str | None = None) -> dict[str, Any]:
    picker: dict[str, Any] = {"replicas": replicas}
    if image is not None:
        picker["image"] = image
    return {"inferencePool": {"enabled": True, "endpointPicker": picker}}


@pytest.mark.parametrize(("replicas", "spread"), [(1, False), (2, True), (5, True)])
def test_ha_pickers_prefer_different_nodes(replicas: int, spread: bool) -> None:
    deploy = render_pool.render_picker_deployment(make_spec(_pool(replicas)), META)
    pod = deploy["spec"]["template"]["spec"]
    assert ("affinity" in pod) == spread
    if not spread:
        return
    anti = pod["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti  # preferred: a one-node cluster still runs
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == deploy["spec"]["template"]["metadata"]["labels"]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]


def _spec(auth: str | None, image: str | None = None) -> Any:
    env = {} if auth is None else {"INFLIGHT_OPERATOR_PICKER_METRICS_AUTH": auth}
    return parse_spec("demo", "ns1", {**MINIMAL_SPEC, **_pool(1, image)}, SpecDefaults.from_env(env))


GIE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.0"


@pytest.mark.parametrize(("auth", "image", "flag"), [
    (None, None, False),  # the pickers' own default: /metrics asks for a token
    ("true", None, False),
    ("false", None, True),
    ("false", GIE, True),  # GIE's epp has the same flag
    ("FALSE", None, True),
])
def test_metrics_auth_is_turned_off_only_when_the_installation_says_so(auth: str | None, image: str | None,
                                                                        flag: bool) -> None:
    spec = _spec(auth, image)
    args = render_pool.render_picker_deployment(spec, META)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (AUTH_FLAG in args) == flag
    assert not any(a.startswith("--metrics-endpoint-auth") and a != AUTH_FLAG for a in args)


@pytest.mark.parametrize("bad", ["", "no", "1", "off"])
def test_a_bad_setting_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="INFLIGHT_OPERATOR_PICKER_METRICS_AUTH"):
        SpecDefaults.from_env({"INFLIGHT_OPERATOR_PICKER_METRICS_AUTH": bad})


def test_the_service_exposes_the_metrics_port_of_the_container() -> None:
    spec = make_spec(_pool(2))
    service = render_pool.render_picker_service(spec, META)
    container = render_pool.render_picker_deployment(spec, META)["spec"]["template"]["spec"]["containers"][0]
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
    (target,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    assert port["port"] == target["containerPort"] == render_pool.EPP_METRICS_PORT
    assert f"{render_pool.EPP_METRICS_PORT}" in container["args"]  # --metrics-port
