"""The day-two pod fields: probe budgets, the kernel cache, scratch storage, the cache's access
mode on stock clusters, ServiceAccount, topology spread, the security context and Service
annotations; every object they render is valid Kubernetes (strict)."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from inflight.operator import render
from tests.operator.helpers import make_spec
from tests.operator.test_render_new_fields import OWNER, _all_objects, _c, _deploy, _env, _pod
from tests.operator.test_spec_and_crd import K8S_VERSION

HF = {"hf": {"repoId": "Qwen/Qwen2.5-7B-Instruct", "revision": "a09a3545"}}
SPREAD = [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway",
           "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}}}]
DAY_TWO = {
    "model": {**HF, "servedModelName": "qwen"},
    "probes": {"startup": {"periodSeconds": 15, "failureThreshold": 240}, "readiness": {"timeoutSeconds": 2}},
    "kernelCache": {"claimName": "triton-cache"},
    "resources": {"gpus": 1, "ephemeralStorage": "40Gi"},
    "serviceAccountName": "llm-runtime",
    "topologySpreadConstraints": SPREAD,
    "service": {"type": "LoadBalancer", "annotations": {"networking.gke.io/load-balancer-type": "Internal"}},
}


def test_probe_overrides_keep_the_paths_and_other_defaults() -> None:
    c = _c(_deploy(DAY_TWO))
    assert c["startupProbe"] == {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 15,
                                 "failureThreshold": 240, "timeoutSeconds": 5}  # one hour to load
    assert c["readinessProbe"]["timeoutSeconds"] == 2 and c["readinessProbe"]["periodSeconds"] == 5
    assert c["livenessProbe"] == _c(_deploy({}))["livenessProbe"]


def test_kernel_cache_scratch_storage_identity_and_spread() -> None:
    d = _deploy(DAY_TWO)
    pod, c = _pod(d), _c(d)
    assert {"name": "kernel-cache", "persistentVolumeClaim": {"claimName": "triton-cache"}} in pod["volumes"]
    assert {"name": "kernel-cache", "mountPath": "/var/cache/inflight"} in c["volumeMounts"]
    assert _env(d, "TRITON_CACHE_DIR") == {"name": "TRITON_CACHE_DIR", "value": "/var/cache/inflight/triton"}
    assert pod["volumes"][0] == {"name": "model", "emptyDir": {"sizeLimit": "40Gi"}}
    assert c["resources"]["requests"]["ephemeral-storage"] == "40Gi"
    assert c["resources"]["limits"]["ephemeral-storage"] == "40Gi"
    assert pod["serviceAccountName"] == "llm-runtime"
    assert pod["topologySpreadConstraints"] == SPREAD
    svc = render.render_service(make_spec(DAY_TWO), OWNER)
    assert svc["metadata"]["annotations"] == {"networking.gke.io/load-balancer-type": "Internal"}


def test_security_context_defaults_skip_the_recursive_chown_and_can_be_replaced() -> None:
    default = _pod(_deploy({}))["securityContext"]
    assert default["fsGroupChangePolicy"] == "OnRootMismatch" and default["runAsUser"] == 1000
    openshift = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert _pod(_deploy({"podSecurityContext": openshift}))["securityContext"] == openshift


@pytest.mark.parametrize(("cache", "mode"), [
    ({"size": "20Gi"}, "ReadWriteOnce"),  # stock classes (standard-rwo, gp3) offer nothing else
    ({"size": "20Gi", "storageClassName": "filestore"}, "ReadWriteMany"),
    ({"size": "20Gi", "storageClassName": "gp3", "accessMode": "ReadWriteOnce"}, "ReadWriteOnce"),
])
def test_cache_access_mode_follows_the_storage_class(cache: dict[str, Any], mode: str) -> None:
    pvc = render.render_cache_pvc(make_spec({"model": {**HF, "cache": cache}}), OWNER)
    assert pvc is not None and pvc["spec"]["accessModes"] == [mode]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model": {**HF, "cache": {"size": "20Gi", "accessMode": "ReadWriteMany"}}}, "needs spec.model.cache.storageClassName"),
    ({"probes": {"startup": {"failureThreshold": 0}}}, "spec.probes.startup.failureThreshold must be an integer >= 1"),
    ({"probes": {"startup": {"path": "/x"}}}, "spec.probes.startup has unknown keys path"),
    ({"probes": {"warmup": {}}}, "spec.probes has unknown keys warmup"),
    ({"kernelCache": {"claimName": "Bad_Name"}}, "spec.kernelCache.claimName"),
    ({"kernelCache": {"claimName": "kc"}, "env": [{"name": "TRITON_CACHE_DIR", "value": "/tmp/t"}]},
     "spec.env sets TRITON_CACHE_DIR"),
    ({"resources": {"ephemeralStorage": "lots"}}, "spec.resources.ephemeralStorage"),
    ({"serviceAccountName": "Not Valid"}, "spec.serviceAccountName"),
    ({"service": {"annotations": {"a": 1}}}, "spec.service.annotations values must be strings"),
    ({"volumes": [{"name": "kernel-cache", "emptyDir": {}}]}, "is used by the operator"),
])
def test_bad_day_two_fields_are_refused_with_the_field_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_spec(overrides)


def test_day_two_objects_are_valid_kubernetes() -> None:
    for obj in _all_objects(make_spec({**DAY_TWO, "model": {**HF, "cache": {"size": "20Gi"}}})):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    for obj in _all_objects(make_spec(DAY_TWO)):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_dropping_the_service_account_and_spread_clears_them_on_patch() -> None:
    spec = make_spec({})
    patch = render.deployment_patch(render.render_deployment(spec, OWNER, 1), autoscaling=False)
    pod = patch["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] is None and pod["topologySpreadConstraints"] is None


def test_the_crd_schema_takes_every_day_two_field() -> None:
    from tests.operator.kmock_schema import strict_errors
    from tests.operator.test_spec_and_crd import _openapi_schema

    schema = _openapi_schema()
    doc = {"apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "demo", "namespace": "ns1"},
           "spec": {**DAY_TWO, "podSecurityContext": {"runAsNonRoot": True}}}
    jsonschema.Draft4Validator(schema).validate(doc)
    assert strict_errors(doc, schema) == []  # nothing pruned as unknown
