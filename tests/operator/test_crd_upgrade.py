"""``helm upgrade`` upgrades the CRD: the chart's pre-upgrade hook (``inflight.operator.crd_upgrade``)
server-side applies the new CRD over the previous chart's, against the emulated API server, and
every field of an existing InferenceDeployment and its status is kept and now in the schema
(the API server would otherwise prune the new fields on the next write)."""

from __future__ import annotations

import asyncio
import copy
import pathlib
from typing import Any

import pytest
import yaml
from kubernetes.aio import client

from inflight.operator import crd, crd_upgrade
from tests.operator import kmock_schema
from tests.operator.kmock_harness import CR_PATH, api_server

PREVIOUS_CRD = pathlib.Path(__file__).parent / "data" / "crd-previous.yaml"
CRD_URL = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd_upgrade.CRD_NAME}"
REPO = pathlib.Path(__file__).resolve().parents[2]

CR: dict[str, Any] = {
    "apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
    "metadata": {"name": "llama", "namespace": "default"},
    "spec": {
        "model": {"pvc": {"claimName": "models", "path": "llama"}},
        "replicas": 2,
        "resources": {"gpus": 1, "cpu": "4", "memory": "32Gi"},
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4},
        # Fields the previous chart's CRD does not know: pruned by an API server still serving it.
        "probes": {"startup": {"periodSeconds": 10, "failureThreshold": 240}},
        "serviceAccountName": "llm-runtime",
        "kernelCache": {"claimName": "triton-cache"},
        "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                       "whenUnsatisfiable": "ScheduleAnyway"}],
        "disruptionBudget": {"maxUnavailable": "25%"},
    },
}
STATUS: dict[str, Any] = {
    "replicas": 3, "readyReplicas": 3, "observedGeneration": 1, "autoscalingBaseReplicas": 2,
    "lastScaleTime": "2026-01-02T03:04:05Z",
    "recommendations": [{"time": "2026-01-02T03:04:05Z", "replicas": 3}],
}


def _schema(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_the_upgrade_hook_applies_the_new_crd_and_keeps_every_field() -> None:
    async def scenario() -> None:
        async with api_server() as cluster:
            previous = yaml.safe_load(PREVIOUS_CRD.read_text())
            previous["status"] = {"storedVersions": ["v1alpha1"]}
            await cluster.request("DELETE", CRD_URL)
            await cluster.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", previous)
            created = await cluster.create_cr(copy.deepcopy(CR))
            await cluster.request("PATCH", f"{CR_PATH.format(ns='default')}/llama/status", {"status": STATUS},
                                  merge=True)
            before = await cluster.cr("llama")
            assert before is not None and before["status"] == {**created.get("status", {}), **STATUS}
            pruned = kmock_schema.strict_errors(before, _schema(previous))
            assert any("probes" in e for e in pruned) and any("autoscalingBaseReplicas" in e for e in pruned), pruned

            api_client = client.ApiClient(client.Configuration(host=cluster.api_url))
            try:
                stored = await crd_upgrade.apply_crd(api_client, crd_upgrade.load_crd(
                    REPO / "charts" / "inflight" / "crds" / "inflight.dev_inferencedeployments.yaml"))
            finally:
                await api_client.close()

            assert stored["spec"]["versions"] == crd.build_crd()["spec"]["versions"]
            after = await cluster.cr("llama")
            assert after == before  # the CR, its spec and its status, untouched
            assert kmock_schema.strict_errors(after, _schema(stored)) == []  # nothing left to prune
            assert cluster.requests_to("PATCH", "/customresourcedefinitions/") == 1

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_an_apply_that_drops_a_stored_version_is_refused() -> None:
    new = crd.build_crd()
    stored = {**new, "status": {"storedVersions": ["v1alpha1", "v1beta1"]}}
    with pytest.raises(crd_upgrade.UpgradeError, match="drops version"):
        crd_upgrade.check_compatible(stored, new)
    crd_upgrade.check_compatible({**new, "status": {"storedVersions": ["v1alpha1"]}}, new)


def test_only_the_inference_deployment_crd_is_applied(tmp_path: pathlib.Path) -> None:
    other = tmp_path / "crd.yaml"
    other.write_text(yaml.safe_dump({"kind": "CustomResourceDefinition", "metadata": {"name": "x.example.com"}}))
    with pytest.raises(crd_upgrade.UpgradeError, match="not inferencedeployments.inflight.dev"):
        crd_upgrade.load_crd(other)
