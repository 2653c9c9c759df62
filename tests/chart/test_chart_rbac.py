"""The chart's ClusterRole/Role grant exactly inflight.operator.rbac.REQUIRED_PERMISSIONS: no
wildcard, nothing missing, nothing extra; namespaced mode grants namespaced resources only in
the watched namespace."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from chart_support import RELEASE_NAMESPACE, WATCH_NAMESPACE, by_kind, is_for_pickers, one

Triple = tuple[str, str, str]  # (api group, resource[/subresource], verb)

# Cluster-scoped resources the operator might read; they can only be granted by a ClusterRole.
CLUSTER_SCOPED = {
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("", "namespaces"),
    ("", "nodes"),
    ("kopf.dev", "clusterkopfpeerings"),
    ("scheduling.k8s.io", "priorityclasses"),
    ("storage.k8s.io", "storageclasses"),
}
RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def _required(which: str = "REQUIRED_PERMISSIONS") -> set[Triple]:
    try:
        rbac = importlib.import_module("inflight.operator.rbac")
        permissions = getattr(rbac, which)
    except (ImportError, AttributeError) as err:
        pytest.fail(
            "inflight.operator.rbac.REQUIRED_PERMISSIONS is missing (docs/CONTRACTS.md, the "
            f"operator issue): the chart's RBAC cannot be checked against it ({err})"
        )
    triples = set()
    for perm in permissions:
        assert isinstance(perm.verbs, tuple), f"{perm}: verbs must be a tuple"
        triples |= {(perm.api_group, perm.resource, verb) for verb in perm.verbs}
    assert triples, f"{which} is empty"
    return triples


def _is_cluster_scoped(triple: Triple) -> bool:
    return (triple[0], triple[1].split("/")[0]) in CLUSTER_SCOPED


def _granted(role: dict[str, Any]) -> set[Triple]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for verb in rule.get("verbs", [])
    }


def _diff(granted: set[Triple], expected: set[Triple]) -> str:
    return f"missing {sorted(expected - granted)}, extra {sorted(granted - expected)}"


@pytest.mark.parametrize("case", ["defaults", "all-on", "namespaced", "all-on-namespaced"])
def test_no_wildcards(objects, case: str) -> None:
    for role in by_kind(objects(case), "ClusterRole") + by_kind(objects(case), "Role"):
        if role["metadata"]["name"].endswith("-epp-metrics-reader"):  # Prometheus's token for the pickers
            assert role["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
            continue
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule, rule
            assert "resourceNames" not in rule or rule["resourceNames"], rule
            for key in ("apiGroups", "resources", "verbs"):
                assert rule.get(key), f"{role['kind']}: rule without {key}: {rule}"
                assert not any("*" in item for item in rule[key]), f"wildcard in {role['kind']}: {rule}"


@pytest.mark.parametrize("case", ["defaults", "all-on"])
def test_cluster_mode_grants_exactly_the_required_permissions(objects, case: str) -> None:
    objs = objects(case)
    assert _watch_roles(objs) == []
    granted = _granted(_operator_cluster_role(objs))
    required = _required()
    assert granted == required, _diff(granted, required)


@pytest.mark.parametrize("case", ["namespaced", "all-on-namespaced"])
def test_namespaced_mode_grants_namespaced_permissions_in_one_namespace(objects, case: str) -> None:
    objs = objects(case)
    required = _required()
    (role,) = _watch_roles(objs)
    assert role["metadata"]["namespace"] == WATCH_NAMESPACE
    namespaced = {t for t in required if not _is_cluster_scoped(t)}
    assert _granted(role) == namespaced, _diff(_granted(role), namespaced)

    cluster_scoped = {t for t in required if _is_cluster_scoped(t)}
    cluster_roles = [r for r in by_kind(objs, "ClusterRole") if not _is_picker_role(r)]
    if not cluster_scoped:
        assert cluster_roles == []
        return
    granted = _granted(_operator_cluster_role(objs))
    # Only cluster-scoped resources cluster-wide: the namespaced ones stay in the Role.
    assert granted == cluster_scoped, _diff(granted, cluster_scoped)


@pytest.mark.parametrize("case", ["defaults", "all-on", "namespaced", "all-on-namespaced"])
def test_bindings_tie_roles_to_the_operator_serviceaccount(objects, case: str) -> None:
    objs = objects(case)
    account = one(objs, "ServiceAccount")["metadata"]
    roles = {(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objs
             if o["kind"] in ("ClusterRole", "Role") and not _is_picker_role(o)}  # the picker's: bound per model
    bindings = [b for b in by_kind(objs, "ClusterRoleBinding") + by_kind(objs, "RoleBinding") if not is_for_pickers(b)]
    assert len(bindings) == len(roles)
    for binding in bindings:
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace")
        assert (ref["kind"], ref["name"], namespace if ref["kind"] == "Role" else None) in roles
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account["name"], "namespace": RELEASE_NAMESPACE}
        ]
    assert account["namespace"] == RELEASE_NAMESPACE


def _is_picker_role(role: dict[str, Any]) -> bool:
    return role["kind"] == "ClusterRole" and is_for_pickers(role)


def _operator_cluster_role(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (role,) = [r for r in by_kind(objs, "ClusterRole") if not _is_picker_role(r)]
    return role


@pytest.mark.parametrize("case", ["defaults", "namespaced"])
def test_the_picker_cluster_role_is_shipped_and_only_it_may_be_bound(objects, case: str) -> None:
    objs = objects(case)
    (picker,) = [r for r in by_kind(objs, "ClusterRole") if r["metadata"]["name"].endswith("-epp")]
    granted = _granted(picker)
    for triple in [("", "pods", "watch"), ("inference.networking.k8s.io", "inferencepools", "list"),
                   ("llm-d.ai", "inferenceobjectives", "watch"), ("coordination.k8s.io", "leases", "update")]:
        assert triple in granted, triple
    operator_rules = [rule for r in by_kind(objs, "ClusterRole") + _watch_roles(objs) if not _is_picker_role(r)
                      for rule in r["rules"] if "clusterroles" in rule["resources"]]
    assert operator_rules == [{"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["clusterroles"],
                               "resourceNames": [picker["metadata"]["name"]], "verbs": ["bind"]}]
    deploy = one(objs, "Deployment")
    env = {e["name"]: e.get("value") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["INFLIGHT_OPERATOR_PICKER_CLUSTER_ROLE"] == picker["metadata"]["name"]


def _watch_roles(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in by_kind(objs, "Role") if not r["metadata"]["name"].endswith("-self")]


@pytest.mark.parametrize("case", ["defaults", "namespaced"])
def test_own_namespace_permissions_are_granted_only_in_the_release_namespace(objects, case: str) -> None:
    objs = objects(case)
    (role,) = [r for r in by_kind(objs, "Role") if r["metadata"]["name"].endswith("-self")]
    assert role["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert _granted(role) == _required("OWN_NAMESPACE_PERMISSIONS")
    for cluster_role in by_kind(objs, "ClusterRole"):  # the picker's is bound per namespace, never cluster-wide
        assert _is_picker_role(cluster_role) or not {t for t in _granted(cluster_role) if t[0] == "coordination.k8s.io"}
