"""The activator the chart ships (activator.enabled): its Deployment, Service and a ServiceAccount
with no token and no role, its values reaching its command line, and its URL and its pods'
selector reaching the operator; two replicas by default, spread across nodes, behind a
PodDisruptionBudget; off by default."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
from chart_support import RELEASE, RELEASE_NAMESPACE, by_kind, parse_manifests

from inflight.operator.activator.__main__ import parse_args
from inflight.operator.context import OperatorConfig
from inflight.operator.scale_to_zero import parse_selector

ON = {"activator": {"enabled": True, "maxHeld": 7, "holdTimeoutSeconds": 900, "retryAfterSeconds": 12}}


def _objects(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    return parse_manifests(chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE, is_install=True))


def _named(objs: list[dict[str, Any]], kind: str, suffix: str) -> list[dict[str, Any]]:
    return [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith(suffix)]


def test_off_by_default(chart: helm.Chart) -> None:
    objs = _objects(chart, {})
    assert not _named(objs, "Deployment", "-activator")
    (operator,) = by_kind(objs, "Deployment")
    env = {e["name"] for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "INFLIGHT_OPERATOR_ACTIVATOR_URL" not in env and "INFLIGHT_OPERATOR_ACTIVATOR_PODS" not in env


def test_renders_a_valid_activator_with_no_api_access(chart: helm.Chart) -> None:
    objs = _objects(chart, ON)
    (deploy,) = _named(objs, "Deployment", "-activator")
    (service,) = _named(objs, "Service", "-activator")
    (account,) = _named(objs, "ServiceAccount", "-activator")
    for obj in (deploy, service, account):
        kubernetes_validate.validate(obj, "1.30", strict=True)
        assert obj["metadata"]["namespace"] == RELEASE_NAMESPACE
    pod = deploy["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert pod["automountServiceAccountToken"] is False and account["automountServiceAccountToken"] is False
    bound = {s.get("name") for b in [*by_kind(objs, "RoleBinding"), *by_kind(objs, "ClusterRoleBinding")]
             for s in b["subjects"]}
    assert account["metadata"]["name"] not in bound  # no role at all
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]
    (operator,) = [d for d in by_kind(objs, "Deployment") if d is not deploy]
    assert deploy["spec"]["selector"]["matchLabels"] != operator["spec"]["selector"]["matchLabels"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "inflight.operator.activator"]
    _, limits = parse_args(container["args"])  # the flags the chart passes are the activator's
    assert (limits.max_held, limits.hold_timeout_s, limits.retry_after_s) == (7, 900.0, 12)


def test_the_operator_gets_the_activator_url(chart: helm.Chart) -> None:
    objs = _objects(chart, ON)
    (operator,) = [d for d in by_kind(objs, "Deployment") if not d["metadata"]["name"].endswith("-activator")]
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    (service,) = _named(objs, "Service", "-activator")
    url = env["INFLIGHT_OPERATOR_ACTIVATOR_URL"]
    assert url == f"http://{service['metadata']['name']}.{RELEASE_NAMESPACE}.svc:8000"
    config = OperatorConfig.from_env({"INFLIGHT_OPERATOR_LIVENESS_PORT": "8080", "INFLIGHT_OPERATOR_ACTIVATOR_URL": url})
    assert config.activator_url == url


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_ha_by_default_and_the_operator_asks_every_activator_pod(chart: helm.Chart) -> None:
    objs = _objects(chart, ON)
    (deploy,) = _named(objs, "Deployment", "-activator")
    (pdb,) = _named(objs, "PodDisruptionBudget", "-activator")
    kubernetes_validate.validate(pdb, "1.30", strict=True)
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["replicas"] == 2 and pdb["spec"]["maxUnavailable"] == 1
    assert _matches(pdb["spec"]["selector"]["matchLabels"], labels)
    (term,) = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert _matches(term["podAffinityTerm"]["labelSelector"]["matchLabels"], labels)
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    (operator,) = [d for d in by_kind(objs, "Deployment") if d is not deploy]
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    config = OperatorConfig.from_env({"INFLIGHT_OPERATOR_LIVENESS_PORT": "8080", **{
        k: env[k] for k in ("INFLIGHT_OPERATOR_ACTIVATOR_URL", "INFLIGHT_OPERATOR_ACTIVATOR_PODS")}})
    selector = parse_selector(config.activator_pods)
    assert _matches(selector, labels)  # the operator finds every activator pod ...
    others = [d for d in by_kind(objs, "Deployment") if d is not deploy]
    assert not any(_matches(selector, d["spec"]["template"]["metadata"]["labels"]) for d in others)  # ... only them
    assert deploy["metadata"]["namespace"] == RELEASE_NAMESPACE  # the operator's own (its Role lists pods there)


def test_one_replica_has_no_pdb(chart: helm.Chart) -> None:
    objs = _objects(chart, {"activator": {**ON["activator"], "replicas": 1}})
    (deploy,) = _named(objs, "Deployment", "-activator")
    assert deploy["spec"]["replicas"] == 1 and "affinity" not in deploy["spec"]["template"]["spec"]
    assert not _named(objs, "PodDisruptionBudget", "-activator")


@pytest.mark.parametrize("bad", [{"replicas": 0}, {"replicas": 11}, {"maxHeld": 0}, {"holdTimeoutSeconds": 0}, {"extra": 1}])
def test_bad_values_are_refused(chart: helm.Chart, bad: dict[str, Any]) -> None:
    with pytest.raises(Exception):  # noqa: B017 (helm's error type)
        _objects(chart, {"activator": {"enabled": True, **bad}})
