"""``spec.nodes`` in the emulator: kmock is the API server (with the LeaderWorkerSet CRD installed, or
not), our kopf operator runs against it, and ``lws_controller`` plays LWS's controller. A CR with
``nodes: 2`` becomes an LWS valid against LWS's schema; the autoscaler scales it 1 -> 2 groups; a
killed worker pod takes its group down and back (LWS's RecreateGroupOnPodRestart) while the CR's
conditions say so; without the LWS CRD the CR says LeaderWorkerSetMissing, and the group is
created once the CRD is installed."""

from __future__ import annotations

import asyncio
from typing import Any

from inflight.operator import render
from tests.operator import kmock_schema
from tests.operator.kmock_harness import Cluster, FakePod, running_operator, wait_for
from tests.operator.lws_controller import LWS_PATH, PODS_PATH, LwsController, install_lws, running
from tests.operator.lws_fixture import lws_schema

NAME = "llama"


def _doc(**extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {"model": {"servedModelName": "llama-70b", "pvc": {"claimName": "models", "path": "llama-70b"}},
                 "resources": {"gpus": 8}, "nodes": 2, **extra},
    }


def _condition(cr: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    return next((c for c in ((cr or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), {})


async def _lws(cluster: Cluster) -> dict[str, Any] | None:
    return await cluster.get(f"{LWS_PATH.format(ns='default')}/{NAME}")


def test_lws_scaled_one_to_two_groups_and_a_killed_worker_recreates_its_group() -> None:
    asyncio.run(asyncio.wait_for(_lws_scaled_one_to_two_groups_and_a_killed_worker_recreates_its_group(), 90))


async def _lws_scaled_one_to_two_groups_and_a_killed_worker_recreates_its_group() -> None:
    pods = [await FakePod().start(), await FakePod().start()]
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetQueueDepth": 2,
                   "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 600, "intervalSeconds": 0.3}
    try:
        async with running_operator() as cluster:
            await install_lws(cluster)
            await cluster.create_cr(_doc(autoscaling=autoscaling))
            lws = await wait_for(lambda: _lws(cluster), what="the LeaderWorkerSet")
            assert kmock_schema.strict_errors(lws, lws_schema()) == []  # as stored, LWS's defaults applied
            assert await cluster.child("deployments", NAME) is None
            service = await wait_for(lambda: cluster.child("services", NAME), what="the Service")  # applied after the LWS
            assert service["spec"]["selector"][render.ROLE_LABEL] == "leader"

            async with running(LwsController(cluster, NAME, pods)) as controller:
                async def status_is(ready: int, desired: int, groups: str) -> bool:
                    cr = await cluster.cr(NAME)
                    st = (cr or {}).get("status") or {}
                    return (st.get("readyReplicas"), st.get("desiredReplicas"), _condition(cr, "GroupsReady").get(
                        "reason")) == (ready, desired, groups)

                await wait_for(lambda: status_is(1, 1, "AllGroupsReady"), what="one ready group")
                pods[0].num_waiting = 10.0  # the leader's queue: the autoscaler wants a second group
                await wait_for(lambda: status_is(2, 2, "AllGroupsReady"), timeout=15, what="two ready groups")
                assert (await _lws(cluster))["spec"]["replicas"] == 2
                events = (await cluster.request("GET", "/api/v1/namespaces/default/events")).get("items") or []
                assert any(e["message"].startswith("scaled 1 -> 2") for e in events), [e["message"] for e in events]
                assert {p["metadata"]["name"] for p in await _pod_list(cluster)} == {
                    "llama-0", "llama-0-1", "llama-1", "llama-1-1"}

                controller.hold.add(0)  # the recreated group stays not ready until released
                await cluster.request("DELETE", f"{PODS_PATH.format(ns='default')}/llama-0-1")  # kill a worker

                async def recreating() -> dict[str, Any] | None:
                    cr = await cluster.cr(NAME)
                    cond = _condition(cr, "GroupsReady")
                    return cr if cond.get("reason") == "GroupRecreating" else None

                cr = await wait_for(recreating, what="GroupsReady=False GroupRecreating")
                groups = _condition(cr, "GroupsReady")
                assert groups["status"] == "False" and "group 0" in groups["message"]
                assert "RecreateGroupOnPodRestart" in groups["message"]
                assert controller.recreated == [0]
                await wait_for(lambda: _ready_is(cluster, "False"), what="Ready=False while the group is down")
                controller.hold.clear()
                await wait_for(lambda: status_is(2, 2, "AllGroupsReady"), what="the group back")
                assert _condition(await cluster.cr(NAME), "Ready")["status"] == "True"

                # a worker's own failure reaches Degraded (the workers serve no HTTP, but they are listed)
                crash = {"containerStatuses": [{"name": "runtime", "ready": False, "restartCount": 3, "state": {
                    "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}}}]}
                await cluster.request("PATCH", f"{PODS_PATH.format(ns='default')}/llama-1-1", {"status": crash},
                                      merge=True)

                async def crashing() -> dict[str, Any] | None:
                    cond = _condition(await cluster.cr(NAME), "Degraded")
                    return cond if cond.get("reason") == "CrashLoopBackOff" else None

                assert "llama-1-1" in (await wait_for(crashing, what="Degraded=CrashLoopBackOff"))["message"]
    finally:
        for pod in pods:
            await pod.stop()


async def _ready_is(cluster: Cluster, value: str) -> bool:
    return _condition(await cluster.cr(NAME), "Ready").get("status") == value


async def _pod_list(cluster: Cluster) -> list[dict[str, Any]]:
    return list((await cluster.request("GET", PODS_PATH.format(ns="default"))).get("items") or [])


def test_missing_lws_crd_is_a_condition_until_it_is_installed() -> None:
    asyncio.run(asyncio.wait_for(_missing_lws_crd_is_a_condition_until_it_is_installed(), 90))


async def _missing_lws_crd_is_a_condition_until_it_is_installed() -> None:
    async with running_operator(retry_base_seconds=0.2, retry_max_seconds=0.5) as cluster:
        await cluster.create_cr(_doc())

        async def degraded() -> dict[str, Any] | None:
            cond = _condition(await cluster.cr(NAME), "Degraded")
            return cond if cond.get("reason") == "LeaderWorkerSetMissing" else None

        cond = await wait_for(degraded, what="Degraded=True LeaderWorkerSetMissing")
        assert cond["status"] == "True"
        assert "install LeaderWorkerSet" in cond["message"] and "leaderworkerset.x-k8s.io/v1" in cond["message"]
        assert await cluster.child("deployments", NAME) is None  # no single-node fallback

        await install_lws(cluster)
        await wait_for(lambda: _lws(cluster), what="the LWS once its CRD is there")

        async def cleared() -> bool:
            return _condition(await cluster.cr(NAME), "Degraded").get("status") == "False"

        await wait_for(cleared, what="Degraded cleared")


def test_single_node_cr_still_gets_a_deployment_and_no_lws_request() -> None:
    asyncio.run(asyncio.wait_for(_single_node_cr_still_gets_a_deployment_and_no_lws_request(), 90))


async def _single_node_cr_still_gets_a_deployment_and_no_lws_request() -> None:
    async with running_operator() as cluster:
        doc = _doc()
        del doc["spec"]["nodes"]
        await cluster.create_cr(doc)
        deployment = await wait_for(lambda: cluster.child("deployments", NAME), what="the Deployment")
        assert render.ROLE_LABEL not in deployment["spec"]["template"]["metadata"]["labels"]
        cr = await wait_for(lambda: _has_status(cluster), what="status")
        assert "GroupsReady" not in {c["type"] for c in cr["status"]["conditions"]}
        assert cluster.requests_to("POST", "leaderworkersets") == 0
        assert cluster.requests_to("GET", "leaderworkersets") == 0


async def _has_status(cluster: Cluster) -> dict[str, Any] | None:
    cr = await cluster.cr(NAME)
    return cr if (cr or {}).get("status", {}).get("observedGeneration") else None
