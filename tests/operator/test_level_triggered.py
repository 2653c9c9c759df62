"""Level-triggered for every child, against kmock: a deleted admin Secret or cache PVC is created
again, a deleted autoscaled Deployment comes back at the autoscaler's count, a mutating webhook
causes no re-apply loop, and a foreign HPA on the Deployment is reported instead of fought."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from inflight.operator import applied, autoscaler
from inflight.operator.autoscaler import Policy, Recommendation
from inflight.operator.children import is_drifted
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import (
    Cluster,
    FakePod,
    pod_object,
    running_operator,
    ticks,
    wait_for,
    wait_ticks,
)

PODS = "/api/v1/namespaces/default/pods"
DEPLOYS = "/apis/apps/v1/namespaces/default/deployments"
HPAS = "/apis/autoscaling/v2/namespaces/default/horizontalpodautoscalers"


def _example(stem: str) -> dict[str, Any]:
    return copy.deepcopy(load_example(next(p for p in EXAMPLES if p.stem == stem)))


def _cond(cr: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    return next((c for c in ((cr or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


def _operator_requests(cluster: Cluster, method: str, path: str) -> list[Any]:
    return [r for r in list(cluster.api) if r.method.value == method and str(r.url.path) == path
            and "kmock" not in r.headers.get("User-Agent", "")]


async def _replicas(cluster: Cluster, name: str, value: int) -> bool:
    deploy = await cluster.child("deployments", name)
    return bool(deploy and deploy["spec"].get("replicas") == value)


def test_a_deleted_admin_secret_and_cache_pvc_are_created_again() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = _example("hf-cached")
            doc["spec"]["replicas"] = 1
            name = doc["metadata"]["name"]
            await cluster.create_cr(doc)
            secret = await wait_for(lambda: cluster.child("secrets", f"{name}-admin"), what="admin Secret")
            pvc = await wait_for(lambda: cluster.child("persistentvolumeclaims", f"{name}-model-cache"), what="PVC")
            await cluster.request("DELETE", f"/api/v1/namespaces/default/secrets/{name}-admin")
            await cluster.request("DELETE", f"/api/v1/namespaces/default/persistentvolumeclaims/{name}-model-cache")

            async def back(kind: str, child: str, old: dict[str, Any]) -> dict[str, Any] | None:
                obj = await cluster.child(kind, child)
                return obj if obj and obj["metadata"]["uid"] != old["metadata"]["uid"] else None

            again = await wait_for(lambda: back("secrets", f"{name}-admin", secret), what="Secret back")
            assert again["data"] == secret["data"]  # the same derived key: the pods keep working
            await wait_for(lambda: back("persistentvolumeclaims", f"{name}-model-cache", pvc), what="PVC back")

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_deleted_autoscaled_deployment_comes_back_at_the_autoscalers_count() -> None:
    async def scenario() -> None:
        pods = [await FakePod(kv_cache_usage=0.95, num_waiting=12).start() for _ in range(3)]
        try:
            async with running_operator() as cluster:
                doc = _example("autoscaled")
                doc["spec"]["autoscaling"].update(maxReplicas=3, intervalSeconds=0.2)
                name = doc["metadata"]["name"]
                await cluster.create_cr(doc)
                await wait_for(lambda: cluster.child("deployments", name), what="deployment")
                for i, pod in enumerate(pods):
                    await cluster.create(PODS, pod_object(f"{name}-{i}", name, pod.port))
                await wait_for(lambda: _replicas(cluster, name, 3), what="scaled to 3")
                await cluster.request("DELETE", f"{DEPLOYS}/{name}")
                await wait_for(lambda: cluster.child("deployments", name), what="deployment re-created")
                creates = _operator_requests(cluster, "POST", DEPLOYS)
                assert [c.data["spec"]["replicas"] for c in creates] == [1, 3]  # not spec.replicas (1)
        finally:
            for pod in pods:
                await pod.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def _sidecar_webhook(plural: str, obj: dict[str, Any]) -> None:
    """A mesh's injector: a sidecar container added to every Deployment written."""
    if plural != "deployments":
        return
    containers = (((obj.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers")
    if isinstance(containers, list) and not any(c.get("name") == "mesh-proxy" for c in containers):
        containers.append({"name": "mesh-proxy", "image": "mesh/proxy:1.0"})


def test_a_mutating_webhook_causes_no_reapply_loop_and_a_hand_edit_is_still_reverted() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            cluster.api.mutators.append(_sidecar_webhook)
            doc = _example("minimal")
            name = doc["metadata"]["name"]
            path = f"{DEPLOYS}/{name}"
            await cluster.create_cr(doc)
            deploy = await wait_for(lambda: cluster.child("deployments", name), what="deployment")
            assert [c["name"] for c in deploy["spec"]["template"]["spec"]["containers"]][-1] == "mesh-proxy"
            await wait_ticks(20)
            writes = _operator_requests(cluster, "PATCH", path) + _operator_requests(cluster, "POST", DEPLOYS)
            assert len(writes) == 1, [w.method.value for w in writes]  # the create; never re-applied

            runtime = deploy["spec"]["template"]["spec"]["containers"][0]
            edited = [{**runtime, "image": "evil:latest"}, {"name": "mesh-proxy", "image": "mesh/proxy:1.0"}]
            await cluster.request("PATCH", path, {"spec": {"template": {"spec": {"containers": edited}}}}, merge=True)

            async def reverted() -> bool:
                live = await cluster.child("deployments", name)
                return live["spec"]["template"]["spec"]["containers"][0]["image"] == runtime["image"]

            await wait_for(reverted, what="hand edit reverted")

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_foreign_hpa_is_reported_once_and_not_fought() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = _example("minimal")
            name = doc["metadata"]["name"]
            await cluster.create_cr(doc)
            await wait_for(lambda: cluster.child("deployments", name), what="deployment")
            hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                   "metadata": {"name": "keda-hpa-llama", "namespace": "default"},
                   "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                            "minReplicas": 1, "maxReplicas": 6}}
            await cluster.create(HPAS, hpa)

            async def reported() -> dict[str, Any] | None:
                cond = _cond(await cluster.cr(name), "ForeignAutoscaler")
                return cond if cond and cond["status"] == "True" else None

            cond = await wait_for(reported, what="ForeignAutoscaler")
            assert "HorizontalPodAutoscaler/keda-hpa-llama" in cond["message"]
            await cluster.request("PATCH", f"{DEPLOYS}/{name}", {"spec": {"replicas": 4}}, merge=True)  # the HPA
            await wait_ticks(15)
            assert await _replicas(cluster, name, 4)  # left to the HPA
            events = [e for e in (await cluster.get("/api/v1/namespaces/default/events"))["items"]
                      if e["reason"] == "ForeignAutoscaler"]
            assert len(events) == 1 and events[0]["type"] == "Warning"
            await cluster.request("DELETE", f"{HPAS}/keda-hpa-llama")

            async def cleared() -> bool:
                cond = _cond(await cluster.cr(name), "ForeignAutoscaler")
                return bool(cond and cond["status"] == "False")

            await wait_for(cleared, what="ForeignAutoscaler cleared")
            await wait_for(lambda: _replicas(cluster, name, 1), what="spec.replicas applied again")

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_replicas_are_never_deleted_by_the_three_way_merge() -> None:
    before = {"spec": {"replicas": 2, "paused": True}}
    assert applied.with_deletions({"spec": {}}, before)["spec"] == {"paused": None}


def test_the_recommendation_history_is_bounded_and_decides_the_same() -> None:
    policy = Policy(min_replicas=1, max_replicas=64, target_kv_cache_usage=0.8, target_queue_depth=4.0,
                    scale_up_window_s=60.0, scale_down_window_s=600.0)
    full: tuple[Recommendation, ...] = ()
    compact: tuple[Recommendation, ...] = ()
    for step in range(5000):  # a decision every 0.2 s for 1000 s, replicas wandering over 1..64
        now = step * 0.2
        rec = Recommendation(now, 1 + (step * 7919 // 13) % 64 if step % 50 else 1 + step % 64)
        full = autoscaler.prune(full + (rec,), policy, now, compact=False)
        compact = autoscaler.prune(compact + (rec,), policy, now)
        assert len(compact) <= 2 * 64
        if step % 97 == 0:
            for later in (0.0, 30.0, 300.0):  # the windows agree now and at any later time
                t = now + later
                windows = [[r.replicas for r in h if t - r.time < w] for h in (full, compact)
                           for w in (policy.scale_up_window_s, policy.scale_down_window_s)]
                up, down, up_c, down_c = windows
                assert (min(up, default=0), max(down, default=0)) == (min(up_c, default=0), max(down_c, default=0))
    assert len(full) > 10 * len(compact)


def test_the_status_is_written_only_when_it_changes_and_a_tick_costs_few_requests() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = _example("minimal")
            name = doc["metadata"]["name"]
            deploy, status = f"{DEPLOYS}/{name}", f"/apis/inflight.dev/v1alpha1/namespaces/default/inferencedeployments/{name}/status"
            await cluster.create_cr(doc)
            await wait_for(lambda: cluster.child("deployments", name), what="deployment")
            await wait_ticks(10)
            before = _operator_requests(cluster, "PATCH", status)
            start, sent = ticks(), len(list(cluster.api))
            await wait_ticks(24)
            assert _operator_requests(cluster, "PATCH", status) == before  # nothing changed: nothing written
            window = [r for r in list(cluster.api)[sent:] if "kmock" not in r.headers.get("User-Agent", "")]
            num_ticks = ticks() - start
            assert len(window) <= 3 * num_ticks, sorted(f"{r.method.value} {r.url.path}" for r in window)

            await cluster.request("PATCH", f"{deploy}/status", {"status": {
                "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}, merge=True)

            async def ready() -> bool:
                return ((await cluster.cr(name)) or {}).get("status", {}).get("readyReplicas") == 1

            await wait_for(ready, what="the change written")

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_drift_is_a_change_since_the_operators_own_write() -> None:
    old_patch = {"metadata": {"name": "x"}, "data": {"k": "1"}}
    new_patch = {"metadata": {"name": "x"}, "data": {"k": "2"}}

    def stored(patch: dict[str, Any], extra: dict[str, Any] | None = None) -> dict[str, Any]:
        obj = applied.with_deletions(patch, None)  # what the API server keeps after the write
        obj["metadata"]["uid"] = "u"
        obj["data"] = {**obj["data"], **(extra or {})}
        return obj

    live = stored(new_patch, {"injected": "by-webhook"})  # a partial apply of a newer spec
    written = {"ConfigMap/x": applied.fingerprint(live)}
    assert not is_drifted(live, old_patch, "ConfigMap/x", written, pending=True)  # no flip-flop
    assert is_drifted(live, old_patch, "ConfigMap/x", written, pending=False)
    assert not is_drifted(live, new_patch, "ConfigMap/x", written)  # the webhook's field is no drift
    edited = copy.deepcopy(live)
    edited["data"]["k"] = "3"
    assert is_drifted(edited, new_patch, "ConfigMap/x", written)  # a hand edit is
    assert is_drifted(None, new_patch, "ConfigMap/x", written)  # and so is a deletion
    fresh: dict[str, str] = {}
    assert not is_drifted(live, new_patch, "ConfigMap/x", fresh) and fresh  # first look: baseline kept
