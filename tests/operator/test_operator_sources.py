"""The operator against kmock for the new sources and settings: an hf resource gets its cache PVC,
admin Secret and a status.modelCache that follows the pods' model-fetch init container; delete
removes what it owns and leaves a user's Secret; an object the API server refuses is Degraded."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

from inflight.operator import admin_keys, render
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import (
    OPERATOR_NAMESPACE,
    Cluster,
    pod_object,
    running_operator,
    wait_for,
)

PODS = "/api/v1/namespaces/default/pods"


def _fetch_status(state: dict[str, Any]) -> dict[str, Any]:
    return {"status": {"initContainerStatuses": [{"name": "model-fetch", "state": state}]}}


async def _cache_state(cluster: Cluster, name: str, state: str) -> dict[str, Any] | None:
    cr = await cluster.cr(name)
    cache = ((cr or {}).get("status") or {}).get("modelCache") or {}
    return cache if cache.get("state") == state else None


def test_hf_resource_cache_pvc_status_and_owned_deletes() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = load_example(next(p for p in EXAMPLES if p.stem == "hf-cached"))
            name = doc["metadata"]["name"]
            await cluster.create_cr(doc)
            await wait_for(lambda: cluster.child("deployments", name), what="deployment")
            cr = await cluster.cr(name)
            pvc = await cluster.child("persistentvolumeclaims", f"{name}-model-cache")
            assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
            assert pvc["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
            admin = await cluster.child("secrets", f"{name}-admin")
            key = base64.b64decode(admin["data"]["admin-api-key"])
            assert len(key) >= 32 and admin["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]

            cache = await wait_for(lambda: _cache_state(cluster, name, "Pending"), what="Pending before any pod")
            assert cache["volume"] == f"pvc/{name}-model-cache"
            assert cache["path"] == "/models/hf/Qwen--Qwen2.5-1.5B-Instruct/main"
            pod = pod_object(f"{name}-0", name, 1, ready=False)
            pod["status"].update(_fetch_status({"running": {}})["status"])
            await cluster.create(PODS, pod)
            await wait_for(lambda: _cache_state(cluster, name, "Downloading"), what="Downloading")
            await cluster.request("PATCH", f"{PODS}/{name}-0", _fetch_status({"terminated": {"exitCode": 0}}),
                                  merge=True)
            await wait_for(lambda: _cache_state(cluster, name, "Ready"), what="Ready after the init container")

            # A reconcile (spec edit) neither rotates the admin key nor recreates the PVC.
            # (Not replicas: more than one is refused with this ReadWriteOnce cache.)
            await cluster.patch_cr(name, {"spec": {"drainTimeoutSeconds": 45}})
            await wait_for(lambda: _observed(cluster, name, 2), what="generation 2")
            assert (await cluster.child("secrets", f"{name}-admin"))["data"] == admin["data"]

            await cluster.request("DELETE", f"/apis/inflight.dev/v1alpha1/namespaces/default/inferencedeployments/{name}")
            await wait_for(lambda: _gone(cluster, name), what="resource released")
            assert await cluster.child("persistentvolumeclaims", f"{name}-model-cache") is None
            assert await cluster.child("secrets", f"{name}-admin") is None

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_admin_secret_holds_the_derived_key_and_an_older_one_is_replaced_once() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = load_example(next(p for p in EXAMPLES if p.stem == "minimal"))
            name = doc["metadata"]["name"]
            # What an older operator (random keys, read back) left: the operator cannot read it.
            old = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-admin", "namespace": "default"},
                   "data": {"admin-api-key": base64.b64encode(b"random-from-before").decode()}}
            await cluster.create("/api/v1/namespaces/default/secrets", old)
            deploy = {"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": {"name": name, "namespace": "default"},
                      "spec": {"selector": {"matchLabels": {"a": "b"}},
                               "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": []}}}}
            await cluster.create("/apis/apps/v1/namespaces/default/deployments", deploy)
            await cluster.create_cr(doc)

            async def derived() -> dict[str, Any] | None:
                secret = await cluster.child("secrets", f"{name}-admin")
                return secret if secret and secret["data"] != old["data"] else None

            secret = await wait_for(derived, what="the admin Secret replaced")
            root = await cluster.get(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/secrets/inflight-operator-root-key")
            root_key = base64.b64decode(root["data"][admin_keys.ROOT_KEY])
            key = base64.b64decode(secret["data"]["admin-api-key"]).decode()
            assert key == admin_keys.derive(root_key, "default", name)
            async def keyed() -> dict[str, Any] | None:  # the pods roll onto the new key
                dep = await cluster.child("deployments", name)
                annotations = dep["spec"]["template"]["metadata"].get("annotations") or {}
                return annotations if render.ADMIN_KEY_ID_ANNOTATION in annotations else None

            annotations = await wait_for(keyed, what="the key id on the pod template")
            assert annotations[render.ADMIN_KEY_ID_ANNOTATION] == admin_keys.key_id(root_key)
            await asyncio.sleep(1.0)  # ticks: the Secret is not replaced again
            assert (await cluster.child("secrets", f"{name}-admin"))["metadata"]["uid"] == secret["metadata"]["uid"]
            reads = [r for r in list(cluster.api) if r.method.value == "GET" and "/secrets" in str(r.url.path)
                     and "kmock" not in r.headers.get("User-Agent", "")]
            assert {str(r.url.path).split("/namespaces/")[1].split("/")[0] for r in reads} == {OPERATOR_NAMESPACE}

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_an_object_the_api_server_refuses_sets_degraded() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            cluster.api.reject_creates["bad-volume"] = (
                'Deployment.apps "bad-volume" is invalid: spec.template.spec.volumes[2].nfs.server: Required value')
            doc = load_example(next(p for p in EXAMPLES if p.stem == "minimal"))
            doc["metadata"]["name"] = "bad-volume"
            doc["spec"]["volumes"] = [{"name": "data", "nfs": {"path": "/x"}}]
            await cluster.create_cr(doc)

            async def degraded() -> dict[str, Any] | None:
                cr = await cluster.cr("bad-volume")
                conds = ((cr or {}).get("status") or {}).get("conditions") or []
                return next((c for c in conds if c["type"] == "Degraded" and c["status"] == "True"), None)

            cond = await wait_for(degraded, what="Degraded=True")
            assert "nfs.server: Required value" in cond["message"]

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _observed(cluster: Cluster, name: str, gen: int) -> bool:
    cr = await cluster.cr(name)
    return bool(cr and (cr.get("status") or {}).get("observedGeneration") == gen)


async def _gone(cluster: Cluster, name: str) -> bool:
    return await cluster.cr(name) is None


def test_inference_pool_on_off_and_missing_crd() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = load_example(next(p for p in EXAMPLES if p.stem == "inference-pool"))
            name = doc["metadata"]["name"]
            pools = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools"
            await cluster.create_cr(doc)
            await wait_for(lambda: cluster.child("services", f"{name}-epp"), what="picker Service (applied last)")
            pool = await cluster.get(f"{pools}/{name}")
            assert pool["spec"]["endpointPickerRef"]["name"] == f"{name}-epp"
            assert await cluster.child("deployments", f"{name}-epp") is not None
            await cluster.patch_cr(name, {"spec": {"inferencePool": {"enabled": False}}})

            async def removed() -> bool:
                return (await cluster.get(f"{pools}/{name}") is None
                        and await cluster.child("deployments", f"{name}-epp") is None)

            await wait_for(removed, what="pool and picker removed when turned off")
            assert await cluster.child("deployments", name) is not None  # the runtime stays

            del cluster.api.resources["inference.networking.k8s.io/v1/inferencepools"]  # CRDs not installed
            doc["metadata"]["name"] = "no-crd"
            await cluster.create_cr(doc)

            async def degraded() -> dict[str, Any] | None:
                cr = await cluster.cr("no-crd")
                conds = ((cr or {}).get("status") or {}).get("conditions") or []
                return next((c for c in conds if c["type"] == "Degraded" and c["status"] == "True"), None)

            cond = await wait_for(degraded, what="Degraded without the InferencePool CRD")
            assert "install the Gateway API Inference Extension CRDs" in cond["message"]

    asyncio.run(asyncio.wait_for(scenario(), 60))
