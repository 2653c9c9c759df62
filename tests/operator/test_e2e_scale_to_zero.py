"""End to end: scale to zero and back through the activator, with a real ``inflight serve``
process standing in for the one pod.

kmock is the API server and our kopf operator runs against it (``activator_url`` set); the
activator runs in this process on a ``ManualClock`` (its idle and wait bounds move only when the
test advances them); the test plays the kubelet: it starts the runtime process when the
Deployment wants a pod and creates the Pod object (Ready) once the process answers ``/ready``, and
stops both at 0 replicas. The run: the idle window passes with nothing held -> 0 replicas; the
first request after idle is held, the operator scales 0 -> 1, the pod comes up and the request is
answered 200 (and a stream passes through); idle again -> 0; a request whose pod never comes up
gets 503 + Retry-After once the wait bound passes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from inflight.operator import admin_keys
from inflight.operator.activator.app import Activator
from inflight.operator.activator.clock import ManualClock
from inflight.operator.activator.holding import Limits
from tests.operator.kmock_harness import OPERATOR_NAMESPACE, Cluster, pod_object, running_operator, wait_for
from tests.operator.runtime_pods import free_port, ready

pytestmark = pytest.mark.slow

NAME = "zero"
IDLE_WINDOW_S = 600.0  # the activator's clock: moved by the test
HOLD_TIMEOUT_S = 900.0
RETRY_AFTER_S = 15
ROOT_KEY = b"zero-root-key-0123456789abcdef-0123"
ADMIN_KEY = admin_keys.derive(ROOT_KEY, "default", NAME)
PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("zero") / "demo"
    subprocess.run([sys.executable, "-m", "inflight.runtime.demo.model", str(path), "--size", "tiny"],
                   check=True, capture_output=True, timeout=120)
    return path


@dataclass
class Kubelet:
    """Starts/stops the one runtime process and its Pod object as the Deployment's replicas say."""

    cluster: Cluster
    model: Path
    port: int
    frozen: bool = False  # a pod that never comes up (no node fits): nothing is started
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    replicas_seen: list[int] = field(default_factory=list)

    async def round(self) -> None:
        deploy = await self.cluster.child("deployments", NAME)
        if deploy is None:
            return
        replicas = deploy["spec"].get("replicas", 0)
        if not self.replicas_seen or self.replicas_seen[-1] != replicas:
            self.replicas_seen.append(replicas)
        pod = await self.cluster.get(f"{PODS}/{NAME}-0")
        if replicas and self.proc is None and not self.frozen:
            self.starts += 1
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "inflight.runtime", "serve", "--model", str(self.model), "--host",
                 "127.0.0.1", "--port", str(self.port), "--served-model-name", "demo", "--drain-timeout", "1",
                 "--num-kv-blocks", "64"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**os.environ, "INFLIGHT_ADMIN_API_KEY": ADMIN_KEY})
        if replicas and self.proc is not None and pod is None and await asyncio.to_thread(ready, self.port):
            await self.cluster.create(PODS, pod_object(f"{NAME}-0", NAME, self.port))
        if not replicas:
            if pod is not None:
                await self.cluster.request("DELETE", f"{PODS}/{NAME}-0")
            await asyncio.to_thread(self.stop)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


@contextlib.contextmanager
def stopped_after(kubelet: Kubelet) -> Iterator[None]:
    try:
        yield
    finally:
        kubelet.stop()


def _doc(port: int) -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "model": {"servedModelName": "demo", "hostPath": {"path": "/models/demo"}},
            "resources": {"gpus": 0},
            "service": {"port": port},  # the activator's backend template: http://127.0.0.1:{port}
            "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 1, "intervalSeconds": 0.3,
                            "scaleDownStabilizationSeconds": IDLE_WINDOW_S},
        },
    }


async def _replicas(cluster: Cluster, value: int) -> bool:
    deploy = await cluster.child("deployments", NAME)
    return bool(deploy and deploy["spec"].get("replicas") == value)


async def _reasons(cluster: Cluster) -> list[str]:
    events = await cluster.get("/api/v1/namespaces/default/events") or {}
    return [e["reason"] for e in events.get("items", []) if e.get("source", {}).get("component") == "inflight-operator"
            and e["reason"] in ("ScaleToZero", "ScaleFromZero")]


async def _serve(activator: Activator) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(activator.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def test_scale_to_zero_holds_the_first_request_and_bounds_the_wait(model: Path) -> None:
    async def scenario() -> None:
        clock = ManualClock()
        activator = Activator(Limits(hold_timeout_s=HOLD_TIMEOUT_S, retry_after_s=RETRY_AFTER_S,
                                     backend_template="http://127.0.0.1:{port}"), clock)
        runner, url = await _serve(activator)
        port = free_port()
        held = lambda: len(activator.backends.get("default", NAME).held)  # noqa: E731
        try:
            async with running_operator(tick_seconds=0.2, activator_url=url) as cluster, \
                    aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
                root = {"apiVersion": "v1", "kind": "Secret",
                        "metadata": {"name": "inflight-operator-root-key", "namespace": OPERATOR_NAMESPACE},
                        "data": {admin_keys.ROOT_KEY: base64.b64encode(ROOT_KEY).decode()}}
                await cluster.create(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/secrets", root)
                await cluster.create_cr(_doc(port))
                kubelet = Kubelet(cluster, model, port)
                stop = asyncio.Event()

                async def kubelet_loop() -> None:
                    while not stop.is_set():
                        await kubelet.round()
                        await asyncio.sleep(0.1)

                with stopped_after(kubelet):
                    loop = asyncio.create_task(kubelet_loop())
                    try:
                        await _run(cluster, session, url, clock, kubelet, held)
                    finally:
                        stop.set()
                        await loop
        finally:
            await runner.cleanup()

    asyncio.run(asyncio.wait_for(scenario(), 280))


async def _scraped_idle(cluster: Cluster) -> bool:
    cr = await cluster.cr(NAME)
    return ((cr or {}).get("status") or {}).get("queueDepth") == 0


async def _run(cluster: Cluster, session: aiohttp.ClientSession, url: str, clock: ManualClock, kubelet: Kubelet,
               held: Any) -> None:
    body = {"model": "demo", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    # 1. Up at 1 replica and scraped; nothing held for the idle window -> 0.
    await wait_for(lambda: _scraped_idle(cluster), timeout=120, what="the pod up and scraped idle")
    assert await _replicas(cluster, 1)
    await clock.advance(IDLE_WINDOW_S - 1)
    await asyncio.sleep(1.0)  # several operator rounds: still inside the window
    assert await _replicas(cluster, 1)
    await clock.advance(1)
    await wait_for(lambda: _replicas(cluster, 0), timeout=20, what="scale to zero after the idle window")
    await wait_for(lambda: _no_pod(cluster), timeout=20, what="the pod gone")
    await wait_for(lambda: _true(kubelet.proc is None), timeout=20, what="the process stopped")
    # 2. The first request after idle: held, 0 -> 1, answered once the pod is ready.
    call = asyncio.create_task(session.post(f"{url}/default/{NAME}/v1/completions", json=body))
    await wait_for(lambda: _true(held() == 1), timeout=20, what="the request held")
    await wait_for(lambda: _replicas(cluster, 1), timeout=20, what="scale from zero")
    resp = await asyncio.wait_for(call, 150)
    answer = await resp.json()
    assert resp.status == 200 and answer["choices"][0]["text"] is not None, answer
    assert kubelet.starts == 2 and held() == 0
    # ... and a stream passes through, event by event.
    async with session.post(f"{url}/default/{NAME}/v1/completions", json={**body, "stream": True}) as stream:
        assert stream.status == 200 and stream.headers["Content-Type"].startswith("text/event-stream")
        events = [line async for line in stream.content if line.startswith(b"data: ")]
    assert events[-1].strip() == b"data: [DONE]" and len(events) >= 2
    # 3. Idle again -> 0; the next pod never comes up: the request gets 503 + Retry-After at the bound.
    kubelet.frozen = True
    await wait_for(lambda: _scraped_idle(cluster), timeout=20, what="idle again")
    await clock.advance(IDLE_WINDOW_S)
    await wait_for(lambda: _replicas(cluster, 0), timeout=20, what="scale to zero again")
    await wait_for(lambda: _true(kubelet.proc is None), timeout=20, what="the pod gone again")
    call = asyncio.create_task(session.post(f"{url}/default/{NAME}/v1/completions", json=body))
    await wait_for(lambda: _true(held() == 1), timeout=20, what="held again")
    await wait_for(lambda: _replicas(cluster, 1), timeout=20, what="scale from zero again")
    await clock.advance(HOLD_TIMEOUT_S - 1)
    await asyncio.sleep(0.5)
    assert not call.done()  # never dropped inside the bound
    await clock.advance(1)
    resp = await asyncio.wait_for(call, 20)
    answer = await resp.json()
    assert resp.status == 503 and resp.headers["Retry-After"] == str(RETRY_AFTER_S), answer
    assert answer["error"]["code"] == "activator_timeout"
    assert kubelet.replicas_seen == [1, 0, 1, 0, 1], kubelet.replicas_seen
    reasons = await wait_for(lambda: _reasons(cluster), timeout=10, what="the scaling Events")
    assert reasons == ["ScaleToZero", "ScaleFromZero", "ScaleToZero", "ScaleFromZero"], reasons


async def _true(value: bool) -> bool:
    return value


async def _no_pod(cluster: Cluster) -> bool:
    return await cluster.get(f"{PODS}/{NAME}-0") is None
