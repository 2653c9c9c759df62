"""The one Kubernetes read behind a pod stuck creating its containers: the Events about it.

A pod that cannot attach or mount its volumes (a ``ReadWriteOnce`` claim already attached to
another node: ``Multi-Attach error``; a missing Secret or NFS server: ``FailedMount``) stays
``Pending``/``ContainerCreating`` with nothing in its status saying why; the attach/detach
controller and the kubelet say it in Events. Owns reading those Events, only when some pod has
been creating for longer than ``pod_health.CREATING_THRESHOLD_SECONDS``, and turning them into
the failure ``Degraded`` reports. The mapping itself is ``pod_health``'s; knows nothing else.
"""

from __future__ import annotations

from typing import Any

from inflight.operator import pod_health
from inflight.operator.kube import EVENTS, KubeClient


async def stuck_pod_events(kube: KubeClient, namespace: str, pods: list[dict[str, Any]], now: float,
                           threshold_s: float = pod_health.CREATING_THRESHOLD_SECONDS) -> list[dict[str, Any]]:
    """The volume Events about pods stuck creating for ``threshold_s`` (none read otherwise)."""
    stuck = {(p.get("metadata") or {}).get("name") for p in pods if pod_health.stuck_creating(p, now, threshold_s)}
    if not stuck:
        return []
    # Events carry no labels; the namespace's are listed and filtered here (only while a pod is stuck).
    return [e for e in await kube.list(EVENTS, namespace, {})
            if e.get("reason") in pod_health.VOLUME_EVENT_REASONS
            and (e.get("involvedObject") or {}).get("name") in stuck]


async def failure(kube: KubeClient, namespace: str, deployment: dict[str, Any], pods: list[dict[str, Any]],
                  now: float) -> pod_health.Failure | None:
    """``pod_health.failure`` with the Events of stuck pods read in."""
    events = await stuck_pod_events(kube, namespace, pods, now)
    return pod_health.failure(deployment, pods, events)
