"""End to end: scale to zero behind two activator replicas, each a real
``python -m inflight.operator.activator`` process with a queue of its own.

kmock is the API server and our kopf operator runs against it, told the activator pods by label
(``activator_pods``); the two activator Pods (in the operator's namespace) point at the two
processes. The backend is a small HTTP server in this process (``/ready`` only while the test,
playing the kubelet, has a pod up; ``/metrics`` with an empty queue; a completion route that can
be made to wait), so the idle window can be short on the activators' real clocks. The run:
one activator down (its Pod still listed) -> never scaled to 0, however long idle; back up ->
0; a request held at the second activator alone -> 0 -> 1 and answered; a request in flight at
the first while the second is idle -> kept at 1; once it is answered -> 0 again.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.operator.kmock_harness import OPERATOR_NAMESPACE, Cluster, pod_object, running_operator, wait_for
from tests.operator.runtime_pods import free_port

pytestmark = pytest.mark.slow

NAME = "zero-ha"
IDLE_WINDOW_S = 1.5  # the activators' real clocks
SELECTOR = "app.kubernetes.io/name=inflight-activator"
PODS = "/api/v1/namespaces/default/pods"
OWN_PODS = f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/pods"


@dataclass
class Backend:
    """The one model pod: ready only while ``up``; completions wait while ``gate`` is clear."""

    up: bool = False
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        self.gate.set()
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._complete)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _ready(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.up else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="# TYPE inflight:kv_cache_usage_perc gauge\n"
                                 'inflight:kv_cache_usage_perc{model_name="m"} 0.0\n'
                                 "# TYPE inflight:num_requests_waiting gauge\n"
                                 'inflight:num_requests_waiting{model_name="m"} 0.0\n')

    async def _complete(self, _: web.Request) -> web.Response:
        await self.gate.wait()
        return web.json_response({"choices": [{"text": "ok"}]})


@dataclass
class ActivatorProcess:
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "inflight.operator.activator", "--host", "127.0.0.1", "--port", str(self.port),
             "--hold-timeout", "120", "--registration-grace", "0", "--probe-interval", "0.1",
             "--backend-template", "http://127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=15)
            self.proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def healthy(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(f"{self.url}/healthz", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False


def _activator_pod(name: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": OPERATOR_NAMESPACE,
                     "labels": {"app.kubernetes.io/name": "inflight-activator"}},
        "spec": {"containers": [{"name": "activator", "image": "x",
                                 "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]}]},
        "status": {"phase": "Running", "podIP": "127.0.0.1",
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }


def _doc(port: int) -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "model": {"servedModelName": "demo", "hostPath": {"path": "/models/demo"}},
            "resources": {"gpus": 0},
            "service": {"port": port},
            "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 1, "intervalSeconds": 0.3,
                            "scaleDownStabilizationSeconds": IDLE_WINDOW_S},
        },
    }


async def _kubelet(cluster: Cluster, backend: Backend, stop: asyncio.Event) -> None:
    """The model's one pod: up (Pod object Ready, backend ready) while the Deployment wants one."""
    while not stop.is_set():
        deploy = await cluster.child("deployments", NAME)
        replicas = (deploy or {}).get("spec", {}).get("replicas", 0)
        pod = await cluster.get(f"{PODS}/{NAME}-0")
        if replicas and pod is None:
            await cluster.create(PODS, pod_object(f"{NAME}-0", NAME, backend.port))
        if not replicas and pod is not None:
            await cluster.request("DELETE", f"{PODS}/{NAME}-0")
        backend.up = bool(replicas)
        await asyncio.sleep(0.1)


async def _replicas(cluster: Cluster, value: int) -> bool:
    deploy = await cluster.child("deployments", NAME)
    return bool(deploy and deploy["spec"].get("replicas") == value)


async def _down(cluster: Cluster, backend: Backend) -> bool:
    return not backend.up and await cluster.get(f"{PODS}/{NAME}-0") is None


async def _reasons(cluster: Cluster) -> list[str]:
    events = await cluster.get("/api/v1/namespaces/default/events") or {}
    return [e["reason"] for e in events.get("items", []) if e.get("source", {}).get("component") == "inflight-operator"
            and e["reason"] in ("ScaleToZero", "ScaleFromZero")]


async def _three_reasons(cluster: Cluster) -> list[str]:
    """The scaling Events' reasons once there are three (or more) of them, else []."""
    reasons = await _reasons(cluster)
    return reasons if len(reasons) >= 3 else []


async def _message_names(cluster: Cluster, text: str) -> bool:
    cr = await cluster.cr(NAME) or {}
    return text in ((cr.get("status") or {}).get("lastDecisionMessage") or "")


def test_scale_to_zero_needs_every_activator_replica_idle_and_sums_their_queues() -> None:
    first, second = ActivatorProcess(free_port()), ActivatorProcess(free_port())

    async def scenario() -> None:
        backend = Backend()
        await backend.start()
        first.start()
        second.start()
        stop = asyncio.Event()
        try:
            async with running_operator(tick_seconds=0.2, activator_pods=SELECTOR) as cluster, \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                for act in (first, second):
                    await wait_for(lambda a=act: a.healthy(session), timeout=30, what="an activator up")
                await cluster.create(OWN_PODS, _activator_pod("activator-a", first.port))
                await cluster.create(OWN_PODS, _activator_pod("activator-b", second.port))
                await cluster.create_cr(_doc(backend.port))
                kubelet = asyncio.create_task(_kubelet(cluster, backend, stop))
                try:
                    await _run(cluster, session, backend, first, second)
                finally:
                    stop.set()
                    await kubelet
        finally:
            await asyncio.to_thread(first.stop)
            await asyncio.to_thread(second.stop)
            if backend.runner is not None:
                await backend.runner.cleanup()

    asyncio.run(asyncio.wait_for(scenario(), 240))


async def _idle_past_window_still(cluster: Cluster, replicas: int, why: str) -> None:
    """Past the idle window, several more decisions: the replicas have not moved, and ``why``
    is in the last decision's message."""
    await asyncio.sleep(IDLE_WINDOW_S + 0.5)
    await wait_for(lambda: _message_names(cluster, why), timeout=20, what=f"a decision naming {why!r}")
    await asyncio.sleep(1.0)  # a few more rounds (every 0.3 s)
    await wait_for(lambda: _message_names(cluster, why), timeout=20, what=f"still {why!r}")
    assert await _replicas(cluster, replicas)


async def _run(cluster: Cluster, session: aiohttp.ClientSession, backend: Backend, first: ActivatorProcess,
               second: ActivatorProcess) -> None:
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4}
    completions = f"/default/{NAME}/v1/completions"
    await wait_for(lambda: _replicas(cluster, 1), timeout=30, what="the first replica")
    # 1. One activator down (its Pod still listed): its queue is unknown, so never to 0.
    await asyncio.to_thread(second.stop)
    await _idle_past_window_still(cluster, 1, f"127.0.0.1:{second.port} cannot be reached")
    # 2. Back up: both idle for the window -> 0.
    second.start()
    await wait_for(lambda: second.healthy(session), timeout=30, what="the second activator back")
    await wait_for(lambda: _replicas(cluster, 0), timeout=30, what="scale to zero with both idle")
    await wait_for(lambda: _down(cluster, backend), timeout=30, what="the pod gone")
    # 3. A request held at the second activator alone: the sum sees it, 0 -> 1, answered.
    call = asyncio.create_task(session.post(f"{second.url}{completions}", json=body))
    await wait_for(lambda: _replicas(cluster, 1), timeout=30, what="scale from zero")
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "ok"
    # 4. A request in flight at the first activator while the second is idle: kept at 1.
    backend.gate.clear()
    call = asyncio.create_task(session.post(f"{first.url}{completions}", json=body))
    await _idle_past_window_still(cluster, 1, "")
    assert not call.done()
    # 5. Answered: idle everywhere -> 0 again.
    backend.gate.set()
    resp = await asyncio.wait_for(call, 60)
    assert resp.status == 200
    await wait_for(lambda: _replicas(cluster, 0), timeout=30, what="scale to zero again")
    # the Event of a decision is posted after the replica count it sets: wait for all three
    expected = ["ScaleToZero", "ScaleFromZero", "ScaleToZero"]
    reasons = await wait_for(lambda: _three_reasons(cluster), timeout=10, what="the scaling Events")
    assert reasons == expected, reasons
