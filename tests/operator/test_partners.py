"""HPA and KEDA as partners (``spec.autoscaling.partner``): parsing, the rendered HPA (validated
against Kubernetes' autoscaling/v2 schema) and KEDA ScaledObject (against a schema written from
KEDA's documented fields: no KEDA CRD is vendored), which HPAs count as foreign, which partner
objects are stale, and end to end in kmock: the operator leaves the replicas to the partner while
its own decision differs, still reports the signals, and deletes its partner object when switched off.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from inflight.operator import children, partners, render_partners
from inflight.operator.kube import HPAS, SCALED_OBJECTS
from inflight.operator.operator_metrics import REGISTRY
from inflight.operator.render import Owner
from tests.operator.helpers import make_spec
from tests.operator.kmock_harness import FakePod, pod_object, running_operator, wait_for, wait_ticks
from tests.operator.test_spec_and_crd import K8S_VERSION

OWNER = Owner(name="demo", uid="0b7c4e1e-0000-4000-8000-000000000001")
PROM = "http://prometheus-operated.monitoring.svc:9090"


def _scaling(partner: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 5, "targetQueueDepth": 4,
                            "partner": partner, **extra}}


def test_partner_is_parsed_and_checked() -> None:
    assert make_spec(_scaling(None)).autoscaling.partner is None
    assert make_spec(_scaling({"kind": "hpa"})).autoscaling.partner == partners.Partner("hpa")
    keda = make_spec(_scaling({"kind": "keda", "prometheusAddress": PROM})).autoscaling.partner
    assert keda == partners.Partner("keda", PROM)
    with pytest.raises(ValueError, match="partner.kind must be one of hpa, keda"):
        make_spec(_scaling({"kind": "vpa"}))
    with pytest.raises(ValueError, match="prometheusAddress is required with kind: keda"):
        make_spec(_scaling({"kind": "keda"}))
    with pytest.raises(ValueError, match="an HPA cannot scale to zero"):
        make_spec(_scaling({"kind": "hpa"}, minReplicas=0))
    assert make_spec(_scaling({"kind": "keda", "prometheusAddress": PROM}, minReplicas=0)).autoscaling.min_replicas == 0


def test_the_rendered_hpa_is_a_valid_autoscaling_v2_object() -> None:
    spec = make_spec(_scaling({"kind": "hpa"}, targetTtftSeconds=2, targetKvCacheUsage=0.8,
                              scaleDownStabilizationSeconds=7200))
    hpa = render_partners.render_hpa(spec, OWNER)
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "demo"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 5)
    metrics = {m["external"]["metric"]["name"]: m["external"]["target"] for m in hpa["spec"]["metrics"]}
    assert metrics == {"inflight_operator_model_queue_depth": {"type": "Value", "value": "4000m"},
                       "inflight_operator_model_kv_cache_usage": {"type": "Value", "value": "800m"},
                       "inflight_operator_model_ttft_backlog_seconds": {"type": "Value", "value": "2000m"}}
    selector = hpa["spec"]["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]
    assert selector == {"infd_namespace": "ns1", "infd": "demo"}
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 3600  # the API's maximum
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    no_ttft = render_partners.render_hpa(make_spec(_scaling({"kind": "hpa"})), OWNER)
    assert len(no_ttft["spec"]["metrics"]) == 2  # no TTFT target: no TTFT metric


# keda.sh/v1alpha1 ScaledObject, from KEDA's documented fields (https://keda.sh/docs/latest/reference/scaledobject-spec/
# and the prometheus scaler's page); unknown keys are refused, as KEDA's CRD (structural schema) prunes them.
_BEHAVIOR = {"type": "object"}
SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                  "name": {"type": "string"},
                                                  "envSourceContainerName": {"type": "string"}}},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "initialCooldownPeriod": {"type": "integer", "minimum": 0},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "fallback": {"type": "object"},
                "advanced": {"type": "object", "additionalProperties": False, "properties": {
                    "restoreToOriginalReplicaCount": {"type": "boolean"},
                    "horizontalPodAutoscalerConfig": {"type": "object", "additionalProperties": False, "properties": {
                        "name": {"type": "string"}, "behavior": _BEHAVIOR}},
                    "scalingModifiers": {"type": "object"}}},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"], "additionalProperties": False,
                    "properties": {
                        "type": {"type": "string"}, "name": {"type": "string"},
                        "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                        "useCachedMetrics": {"type": "boolean"},
                        "authenticationRef": {"type": "object"},
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                    }}},
            },
        },
    },
}
PROMETHEUS_METADATA = {"serverAddress", "query", "threshold", "activationThreshold", "namespace",
                       "customHeaders", "ignoreNullValues", "queryParameters", "unsafeSsl", "timeout"}


def test_the_rendered_scaled_object_matches_kedas_documented_fields() -> None:
    spec = make_spec(_scaling({"kind": "keda", "prometheusAddress": PROM}, minReplicas=0, targetTtftSeconds=1.5))
    obj = render_partners.render_scaled_object(spec, OWNER)
    jsonschema.validate(obj, SCALED_OBJECT_SCHEMA)
    triggers = obj["spec"]["triggers"]
    assert all(set(t["metadata"]) <= PROMETHEUS_METADATA and t["type"] == "prometheus" for t in triggers)
    assert {t["name"]: t["metadata"]["threshold"] for t in triggers} == {
        "queueDepth": "4", "kvCacheUsage": "0.8", "ttftBacklogSeconds": "1.5"}
    assert triggers[0]["metadata"]["query"] == 'max(inflight_operator_model_queue_depth{infd_namespace="ns1",infd="demo"})'
    assert (obj["spec"]["minReplicaCount"], obj["spec"]["maxReplicaCount"]) == (0, 5)
    assert obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["name"] == "keda-hpa-demo"
    kubernetes_validate.validate(  # the HPA behaviour KEDA copies into its HPA is autoscaling/v2's own
        {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
         "spec": {"scaleTargetRef": obj["spec"]["scaleTargetRef"], "maxReplicas": 5,
                  "behavior": obj["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]}},
        K8S_VERSION, strict=True)
    bad = copy.deepcopy(obj)
    bad["spec"]["triggers"][0]["metricType"] = "Average"
    with pytest.raises(jsonschema.ValidationError):  # the schema can fail
        jsonschema.validate(bad, SCALED_OBJECT_SCHEMA)


def test_rendered_children_follow_the_partner() -> None:
    assert render_partners.rendered(make_spec(_scaling(None)), OWNER) == []
    assert [k for k, _, _ in render_partners.rendered(make_spec(_scaling({"kind": "hpa"})), OWNER)] == [HPAS]
    keda = make_spec(_scaling({"kind": "keda", "prometheusAddress": PROM}))
    assert [k for k, _, _ in render_partners.rendered(keda, OWNER)] == [SCALED_OBJECTS]
    off = make_spec({"autoscaling": {"enabled": False, "partner": {"kind": "hpa"}}})
    assert render_partners.rendered(off, OWNER) == []


def test_stale_partner_objects_are_only_the_owned_unwanted_ones() -> None:
    mine = {"metadata": {"ownerReferences": [{"uid": OWNER.uid}]}}
    theirs = {"metadata": {"ownerReferences": [{"uid": "someone-else"}]}}
    spec_off = make_spec(_scaling(None))
    assert render_partners.stale(spec_off, {HPAS: mine, SCALED_OBJECTS: None}, OWNER.uid) == [HPAS]
    assert render_partners.stale(spec_off, {HPAS: theirs, SCALED_OBJECTS: None}, OWNER.uid) == []
    keda = make_spec(_scaling({"kind": "keda", "prometheusAddress": PROM}))
    assert render_partners.stale(keda, {HPAS: mine, SCALED_OBJECTS: mine}, OWNER.uid) == [HPAS]


class _ListKube:
    def __init__(self, hpas: list[dict[str, Any]]) -> None:
        self.hpas = hpas

    async def list(self, kind: Any, namespace: str, selector: dict[str, str]) -> list[dict[str, Any]]:
        return self.hpas


class _Ctx:
    def __init__(self, hpas: list[dict[str, Any]]) -> None:
        self.kube = _ListKube(hpas)
        self.cache = self.kube  # the watch-fed caches answer as the client does


def _hpa(name: str, target: str = "demo") -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"scaleTargetRef": {"kind": "Deployment", "name": target}}}


def test_the_partners_hpa_is_not_foreign_but_another_is() -> None:
    hpas = [_hpa("demo"), _hpa("keda-hpa-demo"), _hpa("other"), _hpa("elsewhere", target="x")]

    def found(spec: Any) -> tuple[str, ...]:
        return asyncio.run(children.foreign_autoscalers(_Ctx(hpas), spec))  # type: ignore[arg-type]

    assert found(make_spec(_scaling({"kind": "hpa"}))) == (
        "HorizontalPodAutoscaler/keda-hpa-demo", "HorizontalPodAutoscaler/other")
    assert found(make_spec(_scaling({"kind": "keda", "prometheusAddress": PROM}))) == (
        "HorizontalPodAutoscaler/demo", "HorizontalPodAutoscaler/other")
    assert len(found(make_spec(_scaling(None)))) == 3  # no partner: every one is foreign


NAME = "partnered"
HPA_PATH = "/apis/autoscaling/v2/namespaces/default/horizontalpodautoscalers"


def _doc() -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {"model": {"servedModelName": "m", "hostPath": {"path": "/models/m"}}, "resources": {"gpus": 0},
                 "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepth": 2,
                                 "scaleDownStabilizationSeconds": 0, "intervalSeconds": 0.2,
                                 "partner": {"kind": "hpa"}}},
    }


def _cond(cr: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    return next((c for c in ((cr or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


def test_partner_mode_end_to_end_in_kmock() -> None:
    async def scenario() -> None:
        pod = await FakePod(kv_cache_usage=0.3, num_waiting=20).start()  # the operator alone would go to 4
        try:
            async with running_operator() as cluster:
                await cluster.create("/api/v1/namespaces/default/pods", pod_object(f"{NAME}-0", NAME, pod.port))
                await cluster.create_cr(_doc())
                hpa = await wait_for(lambda: cluster.get(f"{HPA_PATH}/{NAME}"), what="the partner HPA")
                assert hpa["spec"]["scaleTargetRef"]["name"] == NAME

                async def signals() -> dict[str, Any] | None:
                    st = ((await cluster.cr(NAME)) or {}).get("status") or {}
                    return st if st.get("queueDepth") == 20 and st.get("desiredReplicas") == 4 else None

                st = await wait_for(signals, what="signals in the status")
                assert st["kvCacheUsage"] == 0.3
                assert REGISTRY.get_sample_value("inflight_operator_model_queue_depth",
                                                 {"infd_namespace": "default", "infd": NAME}) == 20
                await wait_ticks(10)
                deploy = await cluster.child("deployments", NAME)
                assert deploy["spec"]["replicas"] == 1  # left to the partner though the operator says 4
                assert ((await cluster.cr(NAME))["status"])["desiredReplicas"] == 4
                assert _cond(await cluster.cr(NAME), "ForeignAutoscaler")["status"] == "False"

                foreign = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                           "metadata": {"name": "other", "namespace": "default"},
                           "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": NAME},
                                    "minReplicas": 1, "maxReplicas": 3}}
                await cluster.create(HPA_PATH, foreign)

                async def flagged() -> dict[str, Any] | None:
                    cond = _cond(await cluster.cr(NAME), "ForeignAutoscaler")
                    return cond if cond and cond["status"] == "True" else None

                cond = await wait_for(flagged, what="ForeignAutoscaler for the foreign HPA")
                assert "HorizontalPodAutoscaler/other" in cond["message"]
                assert f"HorizontalPodAutoscaler/{NAME}" not in cond["message"]
                await cluster.request("DELETE", f"{HPA_PATH}/other")

                await cluster.patch_cr(NAME, {"spec": {"autoscaling": {"partner": None}}})
                await wait_for(lambda: _gone(cluster, f"{HPA_PATH}/{NAME}"), what="the partner HPA deleted")
                await wait_for(lambda: _replicas(cluster, 4), what="the operator writes the replicas again")
        finally:
            await pod.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _gone(cluster: Any, path: str) -> bool:
    return await cluster.get(path) is None


async def _replicas(cluster: Any, value: int) -> bool:
    deploy = await cluster.child("deployments", NAME)
    return bool(deploy and deploy["spec"].get("replicas") == value)
