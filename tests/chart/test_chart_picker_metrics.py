"""The endpoint pickers' /metrics: their token check (``--metrics-endpoint-auth``, on by default in
llm-d's router and GIE's epp) works with what the chart renders, or is turned off by one value.

With ``pickerMetrics.auth`` (the default) the pickers may create TokenReviews and
SubjectAccessReviews (a ClusterRole and a ClusterRoleBinding: both reviews are cluster-scoped, which
the per-model RoleBinding cannot grant) for the ServiceAccounts of the watched namespaces only;
the pickers' ServiceMonitor presents the token of a ServiceAccount allowed to get ``/metrics`` and
nothing else; it selects the Services the operator renders, on their ``metrics`` port. With
``auth: false`` none of that is rendered and the operator renders every picker with
``--metrics-endpoint-auth=false`` (the value reaches it as ``INFLIGHT_OPERATOR_PICKER_METRICS_AUTH``)."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from chart_support import RELEASE, RELEASE_NAMESPACE, by_kind, one, parse_manifests

from inflight.operator import render
from inflight.operator.render import Owner
from inflight.operator.spec import SpecDefaults, parse_spec

MONITOR = {"serviceMonitor": {"enabled": True, "namespace": "monitoring"}}
POOL_SPEC = {"model": {"pvc": {"claimName": "models", "path": "m"}}, "inferencePool": {"enabled": True}}


def _objects(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    return parse_manifests(chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE, is_install=True))


def _named(objs: list[dict[str, Any]], kind: str, suffix: str) -> list[dict[str, Any]]:
    return [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith(suffix)]


def _rendered_picker(objs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The picker Deployment and Service the operator of this chart renders for a pool."""
    env = {e["name"]: e["value"] for e in one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
           if e["name"].startswith("INFLIGHT_OPERATOR_PICKER")}
    spec = parse_spec("demo", "team-a", POOL_SPEC, SpecDefaults.from_env(env))
    out = render.render_pool_objects(spec, Owner(name="demo", uid="0b7c4e1e-0000-4000-8000-000000000009"))
    (deploy,) = by_kind(out, "Deployment")
    (service,) = by_kind(out, "Service")
    return deploy, service


@pytest.mark.parametrize(("values", "groups"), [
    ({}, ["system:serviceaccounts"]),  # cluster mode: every namespace may hold a picker
    ({"watchNamespaces": ["team-a", "team-b"]}, ["system:serviceaccounts:team-a", "system:serviceaccounts:team-b"]),
])
def test_the_pickers_may_review_tokens_in_the_watched_namespaces_only(chart: helm.Chart, values: dict[str, Any],
                                                                      groups: list[str]) -> None:
    objs = _objects(chart, values)
    (role,) = _named(objs, "ClusterRole", "-epp-auth")
    (binding,) = _named(objs, "ClusterRoleBinding", "-epp-auth")
    for obj in (role, binding):
        kubernetes_validate.validate(obj, "1.30", strict=True)
    assert role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
        {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
    ]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert [s["name"] for s in binding["subjects"]] == groups
    assert {s["kind"] for s in binding["subjects"]} == {"Group"}
    args = _rendered_picker(objs)[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--metrics-endpoint-auth") for a in args)  # the pickers' default: on


def test_the_service_monitor_scrapes_the_rendered_pickers_with_a_metrics_only_token(chart: helm.Chart) -> None:
    objs = _objects(chart, MONITOR)
    (monitor,) = _named(objs, "ServiceMonitor", "-epp")
    deploy, service = _rendered_picker(objs)
    labels = service["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    secret_name = endpoint["authorization"]["credentials"]["name"]
    (secret,) = _named(objs, "Secret", "-epp-metrics-reader")
    (account,) = _named(objs, "ServiceAccount", "-epp-metrics-reader")
    (reader,) = _named(objs, "ClusterRole", "-epp-metrics-reader")
    (binding,) = _named(objs, "ClusterRoleBinding", "-epp-metrics-reader")
    for obj in (secret, account, reader, binding):
        kubernetes_validate.validate(obj, "1.30", strict=True)
    assert secret["metadata"]["name"] == secret_name and endpoint["authorization"]["credentials"]["key"] == "token"
    assert secret["type"] == "kubernetes.io/service-account-token"
    assert secret["metadata"]["annotations"]["kubernetes.io/service-account.name"] == account["metadata"]["name"]
    assert secret["metadata"]["namespace"] == account["metadata"]["namespace"] == monitor["metadata"]["namespace"]
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    assert binding["roleRef"]["name"] == reader["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "monitoring"}]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    (target,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert target["targetPort"] in {p["name"] for p in container["ports"]}


def test_auth_off_renders_no_review_rights_no_token_and_pickers_without_the_check(chart: helm.Chart) -> None:
    objs = _objects(chart, {**MONITOR, "pickerMetrics": {"auth": False}})
    assert not [o for o in objs if o["metadata"]["name"].endswith(("-epp-auth", "-epp-metrics-reader"))]
    (monitor,) = _named(objs, "ServiceMonitor", "-epp")
    assert "authorization" not in monitor["spec"]["endpoints"][0]
    args = _rendered_picker(objs)[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--metrics-endpoint-auth=false" in args


def test_pickers_are_left_unscraped_on_request(chart: helm.Chart) -> None:
    objs = _objects(chart, {"serviceMonitor": {"enabled": True, "pickers": False}})
    assert not _named(objs, "ServiceMonitor", "-epp")
    assert not _named(objs, "ServiceAccount", "-epp-metrics-reader")


def test_without_rbac_create_the_chart_grants_nothing(chart: helm.Chart) -> None:
    objs = _objects(chart, {**MONITOR, "rbac": {"create": False}})
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
