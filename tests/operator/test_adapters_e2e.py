"""End to end (issue 49): spec.adapters reaches real ``inflight serve --enable-lora`` processes
standing in for the pods, through the operator's live load/unload and the readiness gate.

kmock is the API server and our kopf operator runs against it. The test plays the kubelet: it
keeps Pod objects in line with the Deployment's replicas (their readiness gates copied from the
template), reports the runtime container ready, and computes the pod's Ready condition as the
kubelet does (containers ready AND every readiness gate True), recording which adapters the
runtime held at the moment a pod turned Ready. A small proxy in front of each runtime plays the
container's mounts: the operator sends ``/adapters/pvc/loras/<dir>`` (the path inside the pod) and
the proxy maps it to the test's directory standing in for the PVC. Checked: an adapter added to
the CR reaches every pod without a rollout (the Deployment's template and generation unchanged),
a new replica holds the adapters before it is Ready, a removed adapter is unloaded, a bad one
(wrong shapes) becomes AdaptersReady=False with the runtime's reason and an Event while the
good ones stay loaded, and a restarted runtime is held un-Ready until it has them again.
"""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import pytest

from inflight.operator import admin_keys
from inflight.operator.render_adapters import READINESS_GATE
from tests.operator.kmock_harness import OPERATOR_NAMESPACE, Cluster, pod_object, running_operator, wait_for
from tests.operator.runtime_pods import PODS, runtime_processes
from tests.server.lora_adapters import make_adapter

pytestmark = pytest.mark.slow

NAME = "lora-e2e"
ROOT_KEY = b"lora-e2e-root-key-0123456789abcdef"
ADMIN_KEY = admin_keys.derive(ROOT_KEY, "default", NAME)
API_KEY = "lora-e2e-inference-key"  # the pods have one: the operator lists adapters with the admin key
POD_PREFIX = "/adapters/pvc/loras/"  # where the operator's pods mount the claim "loras"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[int], Path]]:
    """Two LoRA-enabled runtimes on 127.0.0.1 and the directory standing in for the PVC ``loras``."""
    root = tmp_path_factory.mktemp("lora-e2e")
    model = root / "demo"
    subprocess.run([sys.executable, "-m", "inflight.runtime.demo.model", str(model), "--size", "tiny"],
                   check=True, capture_output=True, timeout=120)
    pvc = root / "pvc"
    make_adapter(model, pvc / "sql", seed=1)
    make_adapter(model, pvc / "chat", seed=2)
    make_adapter(model, pvc / "bad", seed=3, out_features_delta=1)  # B one row too many: refused at load
    args = ["--num-kv-blocks", "64", "--enable-lora", "--max-loras", "4", "--api-key", API_KEY]
    with runtime_processes(model, root, args, ADMIN_KEY) as ports:
        yield ports, pvc


async def _mount_proxy(runtime_port: int, pvc: Path) -> tuple[aiohttp.web.AppRunner, int]:
    """The container's view of the runtime: pod paths in, host paths to the runtime, and back."""
    async def handle(request: aiohttp.web.Request) -> aiohttp.web.Response:
        body = await request.read()
        if request.path == "/v1/load_lora_adapter":
            doc = json.loads(body)
            doc["lora_path"] = doc["lora_path"].replace(POD_PREFIX, f"{pvc}/", 1)
            body = json.dumps(doc).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        async with aiohttp.ClientSession() as session, session.request(
                request.method, f"http://127.0.0.1:{runtime_port}{request.path_qs}", data=body,
                headers=headers) as resp:
            text = (await resp.read()).decode()
            if request.path == "/v1/models" and resp.status == 200:
                text = text.replace(f"{pvc}/", POD_PREFIX)
            return aiohttp.web.Response(status=resp.status, text=text, content_type=resp.content_type)

    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


async def runtime_adapters(port: int) -> set[str]:
    async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
        assert resp.status == 200, await resp.text()
        return {m["id"] for m in (await resp.json())["data"] if m.get("parent")}


class Kubelet:
    """Pod objects for the Deployment's replicas, pod i served by ``proxies[i]`` (runtime ``ports[i]``)."""

    def __init__(self, cluster: Cluster, proxies: list[int], ports: list[int]) -> None:
        self.cluster, self.proxies, self.ports = cluster, proxies, ports
        self.ready_with: dict[str, set[str]] = {}  # pod -> the runtime's adapters when it turned Ready
        self.restarts: dict[str, int] = {}
        self.containers_ready: dict[str, bool] = {}

    async def round(self) -> None:
        deploy = await self.cluster.child("deployments", NAME)
        if deploy is None:
            return
        replicas = deploy["spec"].get("replicas", 0)
        gates = deploy["spec"]["template"]["spec"].get("readinessGates") or []
        for i, proxy in enumerate(self.proxies):
            name = f"{NAME}-{i}"
            pod = await self.cluster.get(f"{PODS}/{name}")
            if i >= replicas:
                if pod is not None:
                    await self.cluster.request("DELETE", f"{PODS}/{name}")
                continue
            if pod is None:
                obj = pod_object(name, NAME, proxy, ready=False)
                obj["spec"]["readinessGates"] = gates
                await self.cluster.create(PODS, obj)
                continue
            await self._sync_status(pod, i)

    async def _sync_status(self, pod: dict[str, Any], i: int) -> None:
        name = pod["metadata"]["name"]
        containers = self.containers_ready.get(name, True)
        conditions = {c["type"]: c for c in pod["status"].get("conditions") or []}
        gates_true = all(conditions.get(g["conditionType"], {}).get("status") == "True"
                         for g in pod["spec"].get("readinessGates") or [])
        ready = containers and gates_true
        want = {"ContainersReady": "True" if containers else "False", "Ready": "True" if ready else "False"}
        restarts = self.restarts.get(name, 0)
        statuses = [{"name": "runtime", "restartCount": restarts, "ready": containers}]
        if all(conditions.get(t, {}).get("status") == s for t, s in want.items()) and (
                pod["status"].get("containerStatuses") == statuses):
            return
        if ready and conditions.get("Ready", {}).get("status") != "True":
            self.ready_with[name] = await runtime_adapters(self.ports[i])
        for t, s in want.items():
            conditions[t] = {"type": t, "status": s}
        await self.cluster.request("PATCH", f"{PODS}/{name}/status", {"status": {
            "conditions": list(conditions.values()), "containerStatuses": statuses}}, merge=True)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.round()
            await asyncio.sleep(0.1)


def _doc(adapters: list[str], replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {"model": {"servedModelName": "demo", "hostPath": {"path": "/models/demo"}},
                 "resources": {"gpus": 0}, "replicas": replicas, "engine": {"maxLoras": 4},
                 "apiKeySecretRef": {"name": "inference-key"},
                 "adapters": _adapters(adapters)},
    }


def _adapters(names: list[str]) -> list[dict[str, Any]]:
    return [{"name": n, "source": {"pvc": {"claimName": "loras", "path": n}}} for n in names]


async def _pod_ready(cluster: Cluster, name: str) -> bool:
    pod = await cluster.get(f"{PODS}/{name}")
    return any(c["type"] == "Ready" and c["status"] == "True" for c in ((pod or {}).get("status") or {}).get(
        "conditions") or [])


async def _everywhere(ports: list[int], want: set[str]) -> bool:
    return all([await runtime_adapters(p) == want for p in ports])


def _condition(cr: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    return next((c for c in ((cr or {}).get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


async def _status_rows(cluster: Cluster, want: list[dict[str, Any]], cond: str, reason: str) -> dict[str, Any] | None:
    cr = await cluster.cr(NAME)
    rows = ((cr or {}).get("status") or {}).get("adapters")
    got = [{k: r.get(k) for k in ("name", "loadedPods", "totalPods")} for r in rows or []]
    ok = got == want and _condition(cr, "AdaptersReady").get("status") == cond
    return cr if ok and _condition(cr, "AdaptersReady").get("reason") == reason else None


def test_adapters_reach_every_pod_live_and_new_pods_before_ready(world: tuple[list[int], Path]) -> None:
    ports, pvc = world

    async def scenario() -> None:
        runners_ports = [await _mount_proxy(p, pvc) for p in ports]
        proxies = [p for _, p in runners_ports]
        stop = asyncio.Event()
        try:
            async with running_operator(tick_seconds=0.2) as cluster:
                await cluster.create(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/secrets", {
                    "apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": "inflight-operator-root-key", "namespace": OPERATOR_NAMESPACE},
                    "data": {admin_keys.ROOT_KEY: base64.b64encode(ROOT_KEY).decode()}})
                await cluster.create_cr(_doc(["sql"], replicas=1))
                kubelet = Kubelet(cluster, proxies, ports)
                task = asyncio.create_task(kubelet.run(stop))
                try:
                    await _run(cluster, kubelet, ports)
                finally:
                    stop.set()
                    await task
        finally:
            for runner, _ in runners_ports:
                await runner.cleanup()

    asyncio.run(asyncio.wait_for(scenario(), 150))


async def _run(cluster: Cluster, kubelet: Kubelet, ports: list[int]) -> None:
    pod0, pod1 = f"{NAME}-0", f"{NAME}-1"
    # 1. The first pod is held out of Ready until its adapter is loaded.
    await wait_for(lambda: _pod_ready(cluster, pod0), timeout=20, what="pod 0 Ready through the gate")
    assert kubelet.ready_with[pod0] == {"sql"}
    await wait_for(lambda: _status_rows(cluster, [{"name": "sql", "loadedPods": 1, "totalPods": 1}],
                                        "True", "AllLoaded"), timeout=10, what="status.adapters sql 1/1")
    deploy = await cluster.child("deployments", NAME)
    assert deploy is not None
    template, generation = deploy["spec"]["template"], deploy["metadata"]["generation"]
    assert {"conditionType": READINESS_GATE} in template["spec"]["readinessGates"]

    # 2. An adapter added to the CR is loaded into the running pod: no rollout.
    await cluster.patch_cr(NAME, {"spec": {"adapters": _adapters(["sql", "chat"])}})
    await wait_for(lambda: _everywhere(ports[:1], {"sql", "chat"}), timeout=15, what="chat loaded live")
    deploy = await cluster.child("deployments", NAME)
    assert deploy is not None and deploy["spec"]["template"] == template
    assert deploy["metadata"]["generation"] == generation  # the pod template never changed: nothing rolled
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{ports[0]}/v1/completions",
            json={"model": "chat", "prompt": "hello", "max_tokens": 4},
            headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
        assert resp.status == 200, await resp.text()

    # 3. A new replica (its runtime started bare) has both before it turns Ready.
    await cluster.patch_cr(NAME, {"spec": {"replicas": 2}})
    await wait_for(lambda: _pod_ready(cluster, pod1), timeout=20, what="pod 1 Ready through the gate")
    assert kubelet.ready_with[pod1] == {"sql", "chat"}

    # 4. A removed adapter is unloaded; a bad one is a condition with the reason, the good one stays.
    await cluster.patch_cr(NAME, {"spec": {"adapters": _adapters(["chat", "bad"])}})
    rows = [{"name": "chat", "loadedPods": 2, "totalPods": 2}, {"name": "bad", "loadedPods": 0, "totalPods": 2}]
    cr = await wait_for(lambda: _status_rows(cluster, rows, "False", "LoadFailed"), timeout=20,
                        what="AdaptersReady False LoadFailed")
    assert await _everywhere(ports, {"chat"})
    message = _condition(cr, "AdaptersReady")["message"]
    assert "adapter bad was refused" in message and "down_proj" in message, message
    (bad_row,) = [r for r in cr["status"]["adapters"] if r["name"] == "bad"]
    assert "down_proj" in bad_row["lastError"]
    events = (await cluster.get("/api/v1/namespaces/default/events") or {}).get("items", [])
    assert any(e["reason"] == "AdapterLoadFailed" and "bad" in e["message"] for e in events)
    assert await _pod_ready(cluster, pod0) and await _pod_ready(cluster, pod1)  # a bad adapter blocks no pod

    # 5. A restarted runtime (it comes back bare) is un-Ready until the operator loaded chat again.
    kubelet.containers_ready[pod1] = False
    await wait_for(lambda: _not(_pod_ready(cluster, pod1)), timeout=10, what="pod 1 not Ready while restarting")
    await wait_for(lambda: _gate_false(cluster, pod1), timeout=10, what="the operator resets pod 1's gate")
    async with aiohttp.ClientSession() as session, session.post(
            f"http://127.0.0.1:{ports[1]}/v1/unload_lora_adapter", json={"lora_name": "chat"},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as resp:
        assert resp.status == 200, await resp.text()
    kubelet.restarts[pod1] = 1
    kubelet.ready_with.pop(pod1)
    kubelet.containers_ready[pod1] = True
    await wait_for(lambda: _pod_ready(cluster, pod1), timeout=20, what="pod 1 Ready again after the restart")
    assert kubelet.ready_with[pod1] == {"chat"}


async def _gate_false(cluster: Cluster, name: str) -> bool:
    pod = await cluster.get(f"{PODS}/{name}") or {}
    return any(c["type"] == READINESS_GATE and c["status"] == "False" for c in pod["status"]["conditions"])


async def _not(check: Any) -> bool:
    return not await check
