"""The LeaderWorkerSet controller, played in the kmock emulator (the operator's tests of ``spec.nodes``).

``install_lws`` makes the emulator serve ``leaderworkerset.x-k8s.io/v1`` the way an API server
with the LWS CRD installed does (the CRD object from ``lws_fixture``, so created LWS objects
get LWS's defaults). ``LwsController`` does, for one LWS, what LWS's controller does for it:
``replicas`` groups of ``size`` pods (``<name>-<g>`` the leader, ``<name>-<g>-<w>`` the
workers) from the leader and worker templates, with LWS's labels (``group-index``,
``worker-index``) and a ready status; the leader points at a ``FakePod`` on 127.0.0.1 through
its ``http`` port. ``RecreateGroupOnPodRestart``: when a pod of a group that was complete is
gone, every pod of the group is deleted and the group is created again, its pods not ready
while the group is in ``hold`` (so a test sees the operator's conditions while it happens).
The LWS status counts groups (``replicas``, ``readyReplicas``, ``updatedReplicas``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator
from typing import Any

import kmock

from tests.operator.kmock_harness import Cluster, FakePod
from tests.operator.lws_fixture import load_crd

LWS_PATH = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets"
PODS_PATH = "/api/v1/namespaces/{ns}/pods"
LABEL = "leaderworkerset.sigs.k8s.io/"


async def install_lws(cluster: Cluster) -> None:
    """Serve the LeaderWorkerSet kind (its CRD created, its resource in discovery)."""
    cluster.api.resources["leaderworkerset.x-k8s.io/v1/leaderworkersets"] = kmock.ResourceInfo(
        kind="LeaderWorkerSet", namespaced=True, verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        subresources={"status", "scale"}, singular="leaderworkerset", shortnames={"lws"},
    )
    crd = load_crd()
    crd.pop("status", None)
    await cluster.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)


class LwsController:
    """LWS's controller for the LWS ``name`` in ``ns`` (call ``run`` in a task, or ``sync`` by hand)."""

    def __init__(self, cluster: Cluster, name: str, pods: list[FakePod], ns: str = "default") -> None:
        self.cluster, self.name, self.ns = cluster, name, ns
        self.fake_pods = pods  # group g's leader is served by pods[g]
        self.hold: set[int] = set()  # groups whose recreated pods stay not ready
        self.recreated: list[int] = []  # groups recreated, in order
        self._complete: set[int] = set()  # groups that had all their pods

    async def _pods(self) -> dict[str, dict[str, Any]]:
        data = await self.cluster.request("GET", PODS_PATH.format(ns=self.ns))
        return {p["metadata"]["name"]: p for p in data.get("items") or []
                if (p["metadata"].get("labels") or {}).get(LABEL + "name") == self.name}

    def _pod(self, lws: dict[str, Any], group: int, worker: int) -> dict[str, Any]:
        tmpl = lws["spec"]["leaderWorkerTemplate"]
        template = copy.deepcopy(tmpl["leaderTemplate"] if worker == 0 else tmpl["workerTemplate"])
        name = f"{self.name}-{group}" if worker == 0 else f"{self.name}-{group}-{worker}"
        labels = {**template["metadata"].get("labels", {}), LABEL + "name": self.name,
                  LABEL + "group-index": str(group), LABEL + "worker-index": str(worker)}
        spec = template["spec"]
        if worker == 0:
            for port in spec["containers"][0].get("ports") or []:
                if port["name"] == "http":
                    port["containerPort"] = self.fake_pods[group].port
        ready = group not in self.hold
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.ns, "labels": labels,
                         "annotations": template["metadata"].get("annotations", {})},
            "spec": spec,
            "status": {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
        }

    async def sync(self) -> None:
        """One pass of the controller."""
        lws = await self.cluster.get(f"{LWS_PATH.format(ns=self.ns)}/{self.name}")
        if lws is None:
            return
        size = lws["spec"]["leaderWorkerTemplate"]["size"]
        replicas = lws["spec"].get("replicas", 1)
        pods = await self._pods()
        ready_groups = 0
        for group in range(replicas):
            names = [f"{self.name}-{group}", *(f"{self.name}-{group}-{w}" for w in range(1, size))]
            present = [n for n in names if n in pods]
            if group in self._complete and len(present) < size:  # RecreateGroupOnPodRestart
                for name in present:
                    await self.cluster.request("DELETE", f"{PODS_PATH.format(ns=self.ns)}/{name}")
                self._complete.discard(group)
                self.recreated.append(group)
                continue  # created again at the next pass, as the controller's next reconcile does
            for worker, name in enumerate(names):
                if name not in pods:
                    await self.cluster.create(PODS_PATH.format(ns=self.ns), self._pod(lws, group, worker))
                elif group not in self.hold and not _ready(pods[name]):
                    await self.cluster.request("PATCH", f"{PODS_PATH.format(ns=self.ns)}/{name}", {"status": {
                        "conditions": [{"type": "Ready", "status": "True"}]}}, merge=True)
            self._complete.add(group)
            ready_groups += group not in self.hold and len(present) == size and all(_ready(pods[n]) for n in names)
        for name, pod in pods.items():  # scaled down: the groups past replicas go
            if int(pod["metadata"]["labels"][LABEL + "group-index"]) >= replicas:
                await self.cluster.request("DELETE", f"{PODS_PATH.format(ns=self.ns)}/{name}")
                self._complete.discard(int(pod["metadata"]["labels"][LABEL + "group-index"]))
        status = {"replicas": replicas, "readyReplicas": ready_groups, "updatedReplicas": replicas}
        if lws.get("status") != {**(lws.get("status") or {}), **status}:
            await self.cluster.request("PATCH", f"{LWS_PATH.format(ns=self.ns)}/{self.name}/status",
                                       {"status": status}, merge=True)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sync()
            await asyncio.sleep(0.05)


def _ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


@contextlib.asynccontextmanager
async def running(controller: LwsController) -> AsyncIterator[LwsController]:
    stop = asyncio.Event()
    task = asyncio.create_task(controller.run(stop))
    try:
        yield controller
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
