"""``helm upgrade`` upgrades the CRD: the chart renders a pre-upgrade hook Job that server-side
applies the CRD the chart ships (from a hook ConfigMap), with a ServiceAccount allowed to read
and patch that one CRD and nothing else; every piece is a hook ordered before the Job.
(The apply itself runs against the emulated API server in tests/operator/test_crd_upgrade.py.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from chart_support import CHART_DIR, RELEASE, RELEASE_NAMESPACE, VALUES_CASES, by_kind, load_values, parse_manifests

from inflight.operator import crd

HOOK_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Job")
NAME = f"{RELEASE}-crd-upgrade"


def _hook_objects(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["kind"]: o for o in objs if o["metadata"]["name"] == NAME and o["kind"] in HOOK_KINDS}


def _upgrade(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    return parse_manifests(chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE, is_upgrade=True))


def test_installs_render_no_upgrade_hook(objects: Callable[[str], list[dict[str, Any]]]) -> None:
    assert _hook_objects(objects("defaults")) == {}  # helm install applies crds/ itself


@pytest.mark.parametrize("case", list(VALUES_CASES))
def test_the_upgrade_hook_applies_the_chart_crd(chart: helm.Chart, case: str) -> None:
    hooks = _hook_objects(_upgrade(chart, load_values(case)))
    assert sorted(hooks) == sorted(HOOK_KINDS)
    for obj in hooks.values():
        kubernetes_validate.validate(obj, "1.30", strict=True)
    weights = {}
    for kind, obj in hooks.items():
        notes = obj["metadata"]["annotations"]
        assert notes["helm.sh/hook"] == "pre-upgrade", kind
        assert notes["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded", kind
        weights[kind] = int(notes["helm.sh/hook-weight"])
    assert weights["Job"] > max(w for k, w in weights.items() if k != "Job")  # RBAC and data first
    assert weights["ClusterRoleBinding"] > weights["ClusterRole"]

    shipped = yaml.safe_load(hooks["ConfigMap"]["data"]["crd.yaml"])
    assert shipped == yaml.safe_load((CHART_DIR / "crds" / "inflight.dev_inferencedeployments.yaml").read_text())
    assert shipped == crd.build_crd()

    (rule,) = hooks["ClusterRole"]["rules"]
    assert rule == {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
                    "resourceNames": ["inferencedeployments.inflight.dev"], "verbs": ["get", "patch"]}
    binding = hooks["ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": RELEASE_NAMESPACE}]

    pod = hooks["Job"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == NAME
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "inflight.operator.crd_upgrade"]
    assert container["args"] == ["--file=/etc/inflight/crd/crd.yaml"]
    assert container["image"].startswith("ghcr.io/inflight-dev/inflight-operator:")
    assert pod["volumes"] == [{"name": "crd", "configMap": {"name": NAME}}]
    assert container["volumeMounts"][0]["mountPath"] == "/etc/inflight/crd"


def test_the_hook_can_be_turned_off(chart: helm.Chart) -> None:
    objs = _upgrade(chart, {**load_values("defaults"), "crds": {"upgrade": False}})
    assert _hook_objects(objs) == {}
    assert by_kind(objs, "Deployment")  # the rest of the chart still renders


def test_the_crd_file_has_no_yaml_anchors() -> None:
    text = (CHART_DIR / "crds" / "inflight.dev_inferencedeployments.yaml").read_text()
    assert "&id0" not in text and "*id0" not in text

