"""Least privilege in cluster mode: ``watchNamespaces`` (beside ``watchNamespace``) gives the
operator one ``--namespace`` per entry and a Role + RoleBinding in each, and leaves the
ClusterRole only the cluster-scoped reads; the NetworkPolicies, the ServiceMonitor and the
uninstall hook follow the same list."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
from chart_support import RELEASE, RELEASE_NAMESPACE, by_kind, one, parse_manifests
from test_chart_rbac import _granted, _is_cluster_scoped, _operator_cluster_role, _required, _watch_roles

NAMESPACES = ["team-a", "team-b"]


def _objects(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    return parse_manifests(chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE, is_install=True))


def _args(objs: list[dict[str, Any]], name_part: str = "") -> list[str]:
    for kind in ("Deployment", "Job"):
        for obj in by_kind(objs, kind):
            if name_part in obj["metadata"]["name"]:
                return obj["spec"]["template"]["spec"]["containers"][0]["args"]
    raise AssertionError(f"no {name_part!r} workload")


def test_a_role_per_watched_namespace_and_only_cluster_scoped_reads_cluster_wide(chart: helm.Chart) -> None:
    objs = _objects(chart, {"watchNamespaces": NAMESPACES})
    required = _required()
    namespaced = {t for t in required if not _is_cluster_scoped(t)}
    roles = _watch_roles(objs)
    assert sorted(r["metadata"]["namespace"] for r in roles) == NAMESPACES
    for role in roles:
        assert _granted(role) == namespaced
    bindings = [b for b in by_kind(objs, "RoleBinding") if not b["metadata"]["name"].endswith("-self")]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == NAMESPACES
    account = one(objs, "ServiceAccount")["metadata"]["name"]
    for binding in bindings:
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": roles[0]["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": RELEASE_NAMESPACE}]
    assert _granted(_operator_cluster_role(objs)) == {t for t in required if _is_cluster_scoped(t)}


def test_kopf_watches_exactly_those_namespaces(chart: helm.Chart) -> None:
    args = _args(_objects(chart, {"watchNamespaces": NAMESPACES}), "")
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={n}" for n in NAMESPACES]
    assert "--all-namespaces" not in args


def test_watch_namespace_and_the_list_merge_without_duplicates(chart: helm.Chart) -> None:
    objs = _objects(chart, {"watchNamespace": "team-a", "watchNamespaces": ["team-a", "team-c"]})
    assert sorted(r["metadata"]["namespace"] for r in _watch_roles(objs)) == ["team-a", "team-c"]
    assert [a for a in _args(objs) if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-c"]


def test_policies_monitor_and_uninstall_follow_the_list(chart: helm.Chart) -> None:
    objs = _objects(chart, {"watchNamespaces": NAMESPACES, "networkPolicy": {"enabled": True},
                            "serviceMonitor": {"enabled": True}})
    assert sorted(p["metadata"]["namespace"] for p in by_kind(objs, "NetworkPolicy")) == NAMESPACES
    runtime_monitor = [m for m in by_kind(objs, "ServiceMonitor")
                       if m["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/name") == "inflight-runtime"]
    assert runtime_monitor[0]["spec"]["namespaceSelector"] == {"matchNames": NAMESPACES}
    (job,) = [j for j in by_kind(objs, "Job") if j["metadata"]["name"].endswith("-release-finalizers")]
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--watch-namespace")] == [f"--watch-namespace={n}" for n in NAMESPACES]


@pytest.mark.parametrize("bad", [["Team_A"], [""], ["a", "a"], "team-a"])
def test_bad_lists_are_refused(chart: helm.Chart, bad: Any) -> None:
    with pytest.raises(Exception):  # noqa: B017 (helm's schema error)
        _objects(chart, {"watchNamespaces": bad})
