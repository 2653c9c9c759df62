"""A pod stuck in ContainerCreating: its volume Events (Multi-Attach, FailedMount) become the
failure ``Degraded`` reports, read from the emulated API server only once the pod is stuck."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

import kopf

from inflight.operator import pod_events, pod_health
from inflight.operator.kube import KubeClient
from tests.operator.kmock_harness import api_server, uncovered_requests

T0 = datetime.datetime(2026, 1, 2, 3, 0, 0, tzinfo=datetime.UTC)
NOW = T0.timestamp() + 600


def _ts(seconds: float) -> str:
    return (T0 + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def creating_pod(name: str, scheduled_at: float = 0.0, reason: str = "ContainerCreating") -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}",
                     "creationTimestamp": _ts(scheduled_at), "labels": {"app": "x"}},
        "status": {"phase": "Pending",
                   "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": _ts(scheduled_at)}],
                   "containerStatuses": [{"name": "runtime", "state": {"waiting": {"reason": reason}}}]},
    }


def event(pod: str, reason: str, message: str, at: float, name: str = "") -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": name or f"{pod}.{reason.lower()}.{int(at)}", "namespace": "default"},
        "involvedObject": {"kind": "Pod", "name": pod, "namespace": "default", "uid": f"uid-{pod}"},
        "reason": reason, "message": message, "type": "Warning", "lastTimestamp": _ts(at),
    }


MULTI_ATTACH = ('Multi-Attach error for volume "pvc-1" Volume is already used by pod(s) llama-0 '
                "on node gpu-a")


def test_a_pod_is_stuck_only_after_the_threshold_and_only_while_creating() -> None:
    pod = creating_pod("p")
    assert pod_health.stuck_creating(pod, NOW, threshold_s=120)
    assert not pod_health.stuck_creating(pod, T0.timestamp() + 60, threshold_s=120)
    running = creating_pod("p")
    running["status"]["containerStatuses"][0]["state"] = {"running": {}}
    assert not pod_health.stuck_creating(running, NOW)
    assert pod_health.stuck_creating(creating_pod("p", reason="PodInitializing"), NOW)


def test_the_newest_volume_event_of_the_pod_is_its_failure() -> None:
    events = [event("p", "FailedMount", "timed out waiting for the condition", at=100),
              event("p", "FailedAttachVolume", MULTI_ATTACH, at=300),
              event("other", "FailedMount", "not this pod", at=500),
              event("p", "Scheduled", "assigned default/p to gpu-b", at=0)]
    found = pod_health.volume_failure(creating_pod("p"), events)
    assert found == pod_health.Failure("FailedAttachVolume", f"pod p: {MULTI_ATTACH}")
    deployment: dict[str, Any] = {"status": {"conditions": []}}
    assert pod_health.failure(deployment, [creating_pod("p")], events) == found
    assert pod_health.failure(deployment, [creating_pod("p")]) is None  # without the Events: nothing


def test_stuck_pods_read_their_events_from_the_api_server() -> None:
    async def scenario() -> None:
        async with api_server() as cluster:
            kube = KubeClient(kopf.ConnectionInfo(server=cluster.api_url, insecure=True))
            try:
                healthy = creating_pod("llama-0", scheduled_at=590)  # just scheduled: not stuck yet
                stuck = creating_pod("llama-1", scheduled_at=0)
                for pod in (healthy, stuck):
                    await cluster.create("/api/v1/namespaces/default/pods", pod)
                await cluster.create("/api/v1/namespaces/default/events",
                                     event("llama-1", "FailedAttachVolume", MULTI_ATTACH, at=200))
                before = cluster.requests_to("GET", "/events")
                assert await pod_events.failure(kube, "default", {}, [healthy], NOW) is None
                assert cluster.requests_to("GET", "/events") == before  # nothing stuck: no read
                found = await pod_events.failure(kube, "default", {}, [healthy, stuck], NOW)
                assert found is not None and found.reason == "FailedAttachVolume"
                assert "Multi-Attach error" in found.message and found.message.startswith("pod llama-1:")
                assert not uncovered_requests(cluster.api), uncovered_requests(cluster.api)
            finally:
                await kube.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
