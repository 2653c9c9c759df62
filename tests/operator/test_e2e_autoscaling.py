"""End to end: two real ``inflight serve`` processes stand in for an InferenceDeployment's pods.

kmock is the API server, our kopf operator runs against it, and a small "kubelet" loop in the
test keeps Pod objects (pointing at 127.0.0.1:PORT) in line with the Deployment's replicas. A
bounded stream of requests, kept in flight until the scale-up, drives the first server's queue
up; the operator scales 1 -> 2 on queue depth, then, after the load ends and the (short)
scale-down window passes, back to 1.
The servers get the admin key a pod gets (env ``INFLIGHT_ADMIN_API_KEY`` from ``<name>-admin``,
which the operator writes with the key it derives from its root key; the root Secret is created
here beforehand so the key is known when the servers start), and the operator's live-config
push reaches them with it.
"""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from inflight.operator import admin_keys
from tests.operator.kmock_harness import (
    OPERATOR_NAMESPACE,
    Cluster,
    running_operator,
    wait_for,
)
from tests.operator.runtime_pods import runtime_processes, sync_pods

pytestmark = pytest.mark.slow

NAME = "demo-e2e"
DOWN_WINDOW_S = 3.0
NUM_REQUESTS = 24  # kept in flight: 4 run, 20 wait on a --max-num-sequences 4 server
MAX_LOAD_REQUESTS = 2000
ROOT_KEY = b"e2e-root-key-0123456789abcdef-0123"  # the operator's root Secret, made beforehand
ADMIN_KEY = admin_keys.derive(ROOT_KEY, "default", NAME)  # what the operator gives the pods
LIVE_QUEUE_LEN = 50  # the CR's maxQueueLen; the servers start with the default


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """Two runtime processes on 127.0.0.1 serving a tiny demo model; yields their ports."""
    model = tmp_path_factory.mktemp("e2e") / "demo"
    subprocess.run([sys.executable, "-m", "inflight.runtime.demo.model", str(model), "--size", "tiny"],
                   check=True, capture_output=True, timeout=120)
    args = ["--num-kv-blocks", "64", "--max-num-sequences", "4"]
    with runtime_processes(model, model.parent, args, ADMIN_KEY) as ports:
        yield ports


def _doc() -> dict[str, Any]:
    return {
        "apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "model": {"servedModelName": "demo", "hostPath": {"path": "/models/demo"}},
            "engine": {"maxNumSequences": 4, "maxQueueLen": LIVE_QUEUE_LEN},
            "resources": {"gpus": 0},
            "autoscaling": {
                "enabled": True, "minReplicas": 1, "maxReplicas": 2,
                "targetKvCacheUsage": 0.8, "targetQueueDepth": 2,
                "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": DOWN_WINDOW_S,
                "intervalSeconds": 0.3,
            },
        },
    }


async def _load_until(port: int, enough: asyncio.Event) -> list[int]:
    """Keep NUM_REQUESTS completions in flight until ``enough`` is set (at most
    MAX_LOAD_REQUESTS in all, so the loop is bounded however fast the engine is); HTTP statuses."""
    body = {"model": "demo", "prompt": "hello world " * 8, "max_tokens": 160, "temperature": 0,
            "ignore_eos": True}
    statuses: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:

        async def worker() -> None:
            while not enough.is_set() and len(statuses) < MAX_LOAD_REQUESTS:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    await resp.read()
                    statuses.append(resp.status)

        await asyncio.gather(*(worker() for _ in range(NUM_REQUESTS)))
    return statuses


async def _kubelet(cluster: Cluster, ports: list[int], seen: dict[str, Any], stop: asyncio.Event) -> None:
    """Keep pod objects in line with the Deployment's replicas; record replicas and reasons seen."""
    while not stop.is_set():
        replicas = await sync_pods(cluster, NAME, ports)
        cr = await cluster.cr(NAME)
        if replicas is not None:
            seen["replicas"].append(replicas)
        reason = ((cr or {}).get("status") or {}).get("lastDecisionReason")
        if reason and (not seen["reasons"] or seen["reasons"][-1] != reason):
            seen["reasons"].append(reason)
        await asyncio.sleep(0.1)


async def _admin_status(port: int, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/admin/config", headers=headers) as resp:
            return resp.status


async def _live_queue_len(port: int) -> bool:
    async with aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with session.get(f"http://127.0.0.1:{port}/admin/config", headers=headers) as resp:
            return resp.status == 200 and (await resp.json()).get("max_queue_len") == LIVE_QUEUE_LEN


async def _replicas(cluster: Cluster, value: int) -> bool:
    deploy = await cluster.child("deployments", NAME)
    return bool(deploy and deploy["spec"].get("replicas") == value)


async def _scale_events(cluster: Cluster) -> list[tuple[str, str]]:
    events = await cluster.get("/api/v1/namespaces/default/events") or {}
    return [(e["reason"], e["message"]) for e in events.get("items", [])
            if e.get("source", {}).get("component") == "inflight-operator"]


async def _events_ending_in_scale_down(cluster: Cluster) -> list[tuple[str, str]] | None:
    events = await _scale_events(cluster)
    return events if events and events[-1][0] == "ScaleDown" else None


async def _cr_settled_at(cluster: Cluster, replicas: int) -> dict[str, Any] | None:
    cr = await cluster.cr(NAME)
    status = (cr or {}).get("status") or {}
    return cr if status.get("lastScaleTime") and status.get("desiredReplicas") == replicas else None


def test_operator_scales_up_under_load_and_down_after_the_window(servers: list[int]) -> None:
    async def scenario() -> None:
        seen: dict[str, Any] = {"replicas": [], "reasons": []}
        async with running_operator(tick_seconds=0.2) as cluster:
            root = {"apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": "inflight-operator-root-key", "namespace": OPERATOR_NAMESPACE},
                    "data": {admin_keys.ROOT_KEY: base64.b64encode(ROOT_KEY).decode()}}
            await cluster.create(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/secrets", root)
            await cluster.create_cr(_doc())
            await wait_for(lambda: _replicas(cluster, 1), timeout=10, what="Deployment with 1 replica")
            stop = asyncio.Event()
            kubelet = asyncio.create_task(_kubelet(cluster, servers, seen, stop))
            try:
                await wait_for(lambda: _live_queue_len(servers[0]), timeout=20, what="live config pushed with the admin key")
                assert await _admin_status(servers[0], None) in (401, 403)  # no key: refused
                load_started = time.monotonic()  # the scale-up decision cannot come before this
                scaled_up = asyncio.Event()
                load = asyncio.create_task(_load_until(servers[0], scaled_up))
                await wait_for(lambda: _replicas(cluster, 2), timeout=20, what="scale-up to 2 under load")
                scaled_up.set()
                statuses = await asyncio.wait_for(load, 90)
                assert statuses and set(statuses) == {200}, statuses
                await wait_for(lambda: _replicas(cluster, 1), timeout=DOWN_WINDOW_S + 15,
                               what="scale-down to 1 after the window")
                # Never before the window (StabilizingDown below shows the window holding it back).
                assert time.monotonic() - load_started >= DOWN_WINDOW_S
                # The event and the status patch follow the Deployment patch polled above.
                events = await wait_for(lambda: _events_ending_in_scale_down(cluster), timeout=15,
                                        what="the ScaleDown event")
                cr = await wait_for(lambda: _cr_settled_at(cluster, 1), timeout=15,
                                    what="status.desiredReplicas 1")
            finally:
                stop.set()
                await kubelet

        reasons = [r for r, _ in events]
        assert reasons[0] in ("ScaleUpQueue", "ScaleUpKvCache"), events
        assert reasons[-1] == "ScaleDown", events
        assert "scaled 1 -> 2" in events[0][1] and "scaled 2 -> 1" in events[-1][1], events
        assert "StabilizingDown" in seen["reasons"], seen["reasons"]
        assert max(seen["replicas"]) == 2 and seen["replicas"][0] == 1
        assert cr["status"]["lastScaleTime"] and cr["status"]["desiredReplicas"] == 1

    asyncio.run(asyncio.wait_for(scenario(), 150))
