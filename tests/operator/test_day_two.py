"""Day two against kmock: drift is repaired by the timer, removed map keys leave the children,
and the autoscaler's stabilization window survives an operator restart (via the status)."""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import pytest

from inflight.operator import applied, autoscaler, pod_health, reconcile, render, status
from inflight.operator.autoscaler import Observations, PodMetrics, Policy, Recommendation
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import (
    Cluster,
    FakePod,
    api_server,
    pod_object,
    running_operator,
    start_operator,
    wait_for,
)

DEPLOY_PATH = "/apis/apps/v1/namespaces/default/deployments"
NAME = "llama-minimal"


def _minimal() -> dict[str, Any]:
    return copy.deepcopy(load_example(next(p for p in EXAMPLES if p.stem == "minimal")))


async def _deployment_where(cluster: Cluster, check: Any) -> dict[str, Any] | None:
    deploy = await cluster.child("deployments", NAME)
    return deploy if deploy and check(deploy) else None


def _container(deploy: dict[str, Any]) -> dict[str, Any]:
    return deploy["spec"]["template"]["spec"]["containers"][0]


def test_deleted_children_come_back_without_a_spec_change() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            cr = await cluster.create_cr(_minimal())
            await wait_for(lambda: cluster.child("poddisruptionbudgets", NAME), what="children")
            await cluster.request("DELETE", f"{DEPLOY_PATH}/{NAME}")
            await cluster.request("DELETE", f"/api/v1/namespaces/default/configmaps/{render.configmap_name(NAME)}")
            assert await cluster.child("deployments", NAME) is None
            deploy = await wait_for(lambda: cluster.child("deployments", NAME), timeout=5, what="repaired")
            assert deploy["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
            await wait_for(lambda: cluster.child("configmaps", render.configmap_name(NAME)), timeout=5,
                           what="configmap repaired")

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_hand_edit_is_reverted_and_fields_others_own_are_left() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            await cluster.create_cr(_minimal())
            deploy = await wait_for(lambda: cluster.child("deployments", NAME), what="deployment")
            image = _container(deploy)["image"]
            edit = {"metadata": {"labels": {"team": "sre"}},  # someone else's label: kept
                    "spec": {"template": {"spec": {"containers": [{**_container(deploy), "image": "evil:latest"}]}}}}
            await cluster.request("PATCH", f"{DEPLOY_PATH}/{NAME}", edit, merge=True)
            repaired = await wait_for(
                lambda: _deployment_where(cluster, lambda d: _container(d)["image"] == image),
                timeout=5, what="image put back")
            assert repaired["metadata"]["labels"]["team"] == "sre"
            patches = cluster.requests_to("PATCH", f"{DEPLOY_PATH}/{NAME}")
            await asyncio.sleep(1.0)  # five ticks with nothing drifted: no more patches
            assert cluster.requests_to("PATCH", f"{DEPLOY_PATH}/{NAME}") == patches

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_changed_node_selector_and_a_removed_annotation_leave_no_stale_keys() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = _minimal()
            doc["spec"]["nodeSelector"] = {"cloud.google.com/gke-accelerator": "nvidia-l4"}
            doc["spec"]["podAnnotations"] = {"team": "ml", "cost-center": "42"}
            await cluster.create_cr(doc)
            await wait_for(lambda: _deployment_where(
                cluster, lambda d: d["spec"]["template"]["spec"].get("nodeSelector")), what="deployment")
            await cluster.patch_cr(NAME, {"spec": {
                "nodeSelector": {"cloud.google.com/gke-accelerator": None, "cloud.google.com/gke-nodepool": "h100"},
                "podAnnotations": {"cost-center": None}}})

            def updated(deploy: dict[str, Any]) -> bool:
                return "cloud.google.com/gke-nodepool" in deploy["spec"]["template"]["spec"]["nodeSelector"]

            deploy = await wait_for(lambda: _deployment_where(cluster, updated), what="new nodeSelector")
            template = deploy["spec"]["template"]
            assert template["spec"]["nodeSelector"] == {"cloud.google.com/gke-nodepool": "h100"}
            assert template["metadata"]["annotations"]["team"] == "ml"
            assert "cost-center" not in template["metadata"]["annotations"]
            assert applied.last_applied(deploy) is not None

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_scale_down_window_survives_a_restart_through_the_status() -> None:
    policy = Policy(min_replicas=1, max_replicas=4, target_kv_cache_usage=0.7, target_queue_depth=4.0,
                    scale_up_window_s=0.0, scale_down_window_s=30.0)
    now = time.time()
    before = reconcile.ResourceState(history=(Recommendation(time=now - 10, replicas=3),),
                                     last_scale_time=now - 10)
    written = {"recommendations": status.recommendations_status(before.history),
               "lastScaleTime": status.rfc3339(now - 10)}
    idle = Observations(current_replicas=3, ready=tuple(
        PodMetrics(name=f"p{i}", kv_cache_usage=0.0, num_waiting=0.0) for i in range(3)))

    restarted = reconcile.ResourceState()
    reconcile.seed_from_status(restarted, written)
    assert [r.replicas for r in restarted.history] == [3]
    assert abs(restarted.history[0].time - (now - 10)) < 0.01
    assert autoscaler.decide(idle, policy, restarted.history, now).desired == 3  # window holds
    assert autoscaler.decide(idle, policy, restarted.history, now + 25).desired == 1  # window over

    forgetful = reconcile.ResourceState()  # what a restart did before: scale-down at once
    assert autoscaler.decide(idle, policy, forgetful.history, now).desired == 1

    reconcile.seed_from_status(restarted, {"recommendations": []})  # seeded once, never again
    assert len(restarted.history) == 1


def test_garbage_in_the_status_history_is_skipped() -> None:
    junk = {"recommendations": [{"time": "yesterday", "replicas": 2}, {"time": "2026-11-24T10:00:00Z"},
                                {"time": "2026-11-24T10:00:00.250Z", "replicas": True}, None,
                                {"time": "2026-11-24T10:00:00.250Z", "replicas": 2}]}
    history = status.recommendations_from_status(junk)
    assert [(r.replicas, r.time % 1) for r in history] == [(2, 0.25)]


def test_applied_records_deletions_and_drift() -> None:
    old = {"spec": {"nodeSelector": {"a": "1", "b": "2"}, "replicas": 2, "args": ["x"]}}
    new = {"spec": {"nodeSelector": {"b": "3"}, "args": ["y"]}}
    assert applied.deletions(old, new) == {"spec": {"nodeSelector": {"a": None}, "replicas": None}}
    patch = applied.with_deletions(new, old)
    assert patch["spec"]["nodeSelector"] == {"b": "3", "a": None}
    assert applied.last_applied(patch) == new
    live = {"metadata": {"uid": "u"}, "spec": {"nodeSelector": {"b": "3", "z": "9"}, "args": ["y"]}}
    assert not applied.drifted(live, new)  # extra keys others set do not count
    assert applied.drifted({"spec": {"nodeSelector": {"b": "4"}, "args": ["y"]}}, new)
    assert applied.drifted({"spec": {"nodeSelector": {"b": "3"}, "args": ["y", "z"]}}, new)
    assert applied.drifted(None, new)


PODS_PATH = "/api/v1/namespaces/default/pods"


def _cond(cr: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    return next((c for c in ((cr or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


UNSCHEDULABLE = {"phase": "Pending", "conditions": [{
    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
    "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}
PULL_ERROR = {"phase": "Pending", "containerStatuses": [{
    "name": "runtime", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
    "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/x:typo"'}}}]}
CRASH_LOOP = {"phase": "Running", "containerStatuses": [{
    "name": "runtime", "ready": False, "restartCount": 4, "image": "x", "imageID": "",
    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
    "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}]}


def test_pod_failures_surface_as_degraded_with_kubernetes_reason() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            await cluster.create_cr(_minimal())
            await wait_for(lambda: cluster.child("deployments", NAME), what="deployment")
            pod = {"apiVersion": "v1", "kind": "Pod",
                   "metadata": {"name": f"{NAME}-0", "namespace": "default",
                                "labels": render.common_labels(NAME)},
                   "spec": {"containers": [{"name": "runtime", "image": "x"}]}}
            await cluster.create(PODS_PATH, {**pod, "status": UNSCHEDULABLE})
            for pod_status, reason, words in [
                (UNSCHEDULABLE, "Unschedulable", "Insufficient nvidia.com/gpu"),
                (PULL_ERROR, "ImagePullBackOff", "ghcr.io/x:typo"),
                (CRASH_LOOP, "CrashLoopBackOff", "OOMKilled (code 137)"),
            ]:
                replaced = {"conditions": [], "containerStatuses": [], **pod_status}  # lists replace whole
                await cluster.request("PATCH", f"{PODS_PATH}/{NAME}-0", {"status": replaced}, merge=True)

                async def degraded(reason: str = reason) -> dict[str, Any] | None:
                    cond = _cond(await cluster.cr(NAME), "Degraded")
                    return cond if cond and cond["status"] == "True" and cond["reason"] == reason else None

                cond = await wait_for(degraded, what=f"Degraded {reason}")
                assert words in cond["message"] and f"{NAME}-0" in cond["message"]
            cr = await cluster.cr(NAME)
            assert _cond(cr, "Ready")["status"] == "False" and _cond(cr, "Available")["status"] == "False"
            await cluster.request("DELETE", f"{PODS_PATH}/{NAME}-0")

            async def recovered() -> bool:
                cond = _cond(await cluster.cr(NAME), "Degraded")
                return bool(cond and cond["status"] == "False")

            await wait_for(recovered, what="Degraded back to False")

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_unscrapable_pods_set_metrics_unavailable_and_an_event() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = load_example(next(p for p in EXAMPLES if p.stem == "autoscaled"))
            doc["spec"]["autoscaling"].update(intervalSeconds=0.2)
            await cluster.create_cr(doc)
            name = doc["metadata"]["name"]
            await wait_for(lambda: cluster.child("deployments", name), what="deployment")
            await cluster.create(PODS_PATH, pod_object(f"{name}-0", name, 1))  # nothing listens on :1

            async def unavailable() -> dict[str, Any] | None:
                cond = _cond(await cluster.cr(name), "MetricsUnavailable")
                return cond if cond and cond["status"] == "True" else None

            cond = await wait_for(unavailable, what="MetricsUnavailable")
            assert "127.0.0.1:1/metrics" in cond["message"]
            events = (await cluster.get("/api/v1/namespaces/default/events"))["items"]
            assert [e["type"] for e in events if e["reason"] == "MetricsUnavailable"] == ["Warning"]

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_bad_edit_keeps_autoscaling_on_the_last_good_spec_and_scaling_the_cr_is_a_conflict() -> None:
    async def scenario() -> None:
        pods = [await FakePod(kv_cache_usage=0.95, num_waiting=12).start() for _ in range(3)]
        try:
            async with running_operator() as cluster:
                doc = load_example(next(p for p in EXAMPLES if p.stem == "autoscaled"))
                doc["spec"]["autoscaling"].update(maxReplicas=3, intervalSeconds=0.2, scaleDownStabilizationSeconds=0)
                await cluster.create_cr(doc)
                name = doc["metadata"]["name"]
                await wait_for(lambda: cluster.child("deployments", name), what="deployment")
                await cluster.patch_cr(name, {"spec": {"engine": {"maxNumTokens": -5}}})  # refused by the parser

                async def invalid() -> bool:
                    cond = _cond(await cluster.cr(name), "Degraded")
                    return bool(cond and cond["reason"] == "InvalidSpec")

                await wait_for(invalid, what="Degraded InvalidSpec")
                for i, pod in enumerate(pods):
                    await cluster.create(PODS_PATH, pod_object(f"{name}-{i}", name, pod.port))
                await wait_for(lambda: _replicas(cluster, name, 3), what="scaled up despite the bad edit")
                assert _cond(await cluster.cr(name), "Degraded")["reason"] == "InvalidSpec"  # not overwritten

                base = (await cluster.cr(name))["status"]["autoscalingBaseReplicas"]
                assert base != 2
                await cluster.patch_cr(name, {"spec": {"engine": {"maxNumTokens": None}, "replicas": 2}})

                async def conflict() -> dict[str, Any] | None:
                    cond = _cond(await cluster.cr(name), "AutoscalingConflict")
                    return cond if cond and cond["status"] == "True" else None

                cond = await wait_for(conflict, what="AutoscalingConflict")
                assert "spec.replicas was changed to 2" in cond["message"]
                await asyncio.sleep(0.6)  # the autoscaler keeps its 3
                assert await _replicas(cluster, name, 3)
                await cluster.patch_cr(name, {"spec": {"replicas": base}})

                async def cleared() -> bool:
                    cond = _cond(await cluster.cr(name), "AutoscalingConflict")
                    return bool(cond and cond["status"] == "False")

                await wait_for(cleared, what="conflict cleared")
        finally:
            for pod in pods:
                await pod.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _replicas(cluster: Cluster, name: str, value: int) -> bool:
    deploy = await cluster.child("deployments", name)
    return bool(deploy and deploy["spec"].get("replicas") == value)


def test_deployment_failures_come_before_pod_failures_and_messages_are_bounded() -> None:
    quota = {"status": {"conditions": [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                        "message": 'pods "x" is forbidden: exceeded quota: gpu-quota'}]}}
    stalled = {"status": {"conditions": [{"type": "Progressing", "status": "False",
                                          "reason": "ProgressDeadlineExceeded", "message": "timed out"}]}}
    crash = {"metadata": {"name": "p"}, "status": CRASH_LOOP}
    assert pod_health.failure(quota, [crash]).reason == "FailedCreate"
    assert pod_health.failure(stalled, []).reason == "ProgressDeadlineExceeded"
    both = pod_health.failure({}, [crash, {"metadata": {"name": "q"}, "status": PULL_ERROR}])
    assert both.reason == "CrashLoopBackOff" and both.message.endswith("(and 1 more pod(s) failing)")
    assert pod_health.failure({}, [{"metadata": {"name": "ok"}, "status": {"phase": "Running"}}]) is None
    long = {"metadata": {"name": "p"}, "status": {"conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "n" * 5000}]}}
    assert len(pod_health.pod_failure(long).message) == pod_health.MESSAGE_LIMIT


def test_operator_metrics_count_what_happened_and_serve_on_the_configured_port() -> None:
    import socket
    import urllib.request

    from inflight.operator import operator_metrics

    def value(name: str, **labels: str) -> float:
        return operator_metrics.REGISTRY.get_sample_value(name, labels or None) or 0.0

    before = value("inflight_operator_drift_repairs_total", kind="Deployment")
    applied_before = value("inflight_operator_reconciles_total", result="applied")

    async def scenario() -> None:
        async with running_operator() as cluster:
            await cluster.create_cr(_minimal())
            await wait_for(lambda: cluster.child("poddisruptionbudgets", NAME), what="children")
            await cluster.request("DELETE", f"{DEPLOY_PATH}/{NAME}")
            await wait_for(lambda: cluster.child("deployments", NAME), timeout=5, what="repaired")

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert value("inflight_operator_drift_repairs_total", kind="Deployment") == before + 1
    assert value("inflight_operator_reconciles_total", result="applied") == applied_before + 1

    assert operator_metrics.start_from_env({}) is None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert operator_metrics.start_from_env({operator_metrics.PORT_ENV: str(port)}, addr="127.0.0.1") == port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert "inflight_operator_drift_repairs_total" in resp.read().decode()
    with pytest.raises(ValueError, match="must be a port number"):
        operator_metrics.start_from_env({operator_metrics.PORT_ENV: "metrics"})


def test_an_operator_restarted_mid_window_does_not_scale_down_before_the_window_ends() -> None:
    window = 8.0

    async def scenario() -> None:
        pods = [await FakePod(kv_cache_usage=0.95, num_waiting=12).start() for _ in range(3)]
        try:
            async with api_server() as cluster:
                doc = load_example(next(p for p in EXAMPLES if p.stem == "autoscaled"))
                doc["spec"]["autoscaling"].update(maxReplicas=3, intervalSeconds=0.2,
                                                  scaleDownStabilizationSeconds=window)
                name = doc["metadata"]["name"]
                first = start_operator(cluster)
                await asyncio.wait_for(first.ready.wait(), 10)
                await cluster.create_cr(doc)
                await wait_for(lambda: cluster.child("deployments", name), what="deployment")
                for i, pod in enumerate(pods):
                    await cluster.create(PODS_PATH, pod_object(f"{name}-{i}", name, pod.port))
                await wait_for(lambda: _replicas(cluster, name, 3), what="scaled up to 3")
                for pod in pods:  # the load is gone: a scale-down is due once the window has passed
                    pod.kv_cache_usage, pod.num_waiting = 0.0, 0.0
                await asyncio.sleep(0.5)  # a few idle rounds, written into status.recommendations
                await first.shutdown()
                stopped = time.monotonic()
                assert max(r["replicas"] for r in (await cluster.cr(name))["status"]["recommendations"]) >= 3

                second = start_operator(cluster)  # the restart (chart upgrade, OOM, node drain)
                try:
                    await asyncio.wait_for(second.ready.wait(), 10)
                    await asyncio.sleep(2.0)
                    assert time.monotonic() - stopped < window  # still inside the window
                    assert await _replicas(cluster, name, 3), "the restarted operator forgot the window"
                    await wait_for(lambda: _replicas(cluster, name, 1), timeout=window + 10,
                                   what="scale-down once the window has passed")
                finally:
                    await second.shutdown()
        finally:
            for pod in pods:
                await pod.stop()

    asyncio.run(asyncio.wait_for(scenario(), 90))
