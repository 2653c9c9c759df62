"""End to end: the TTFT-backlog signal scales up on a prefill-heavy burst that KV usage and
queue depth do not see, with real ``inflight serve`` processes standing in for the pods.

kmock is the API server and our kopf operator runs against it, as in test_e2e_autoscaling.py
(they share `runtime_pods.py`: the runtime processes and the kubelet round). The runtimes run the simulated device
with a slow modelled prefill (``prefill_token_ms``) and a small step budget, so a few long
prompts with ``max_tokens: 1`` build seconds of prefill backlog while KV usage stays low
(the cache is large and the prompts leave as soon as they are prefilled) and at most a couple
of requests wait (fewer than the queue target). With ``targetTtftSeconds`` unset the operator
looks at the burst for several decisions and keeps 1 replica; with it set, it scales to 2 and
says why (``ScaleUpTtft``, the backlog and its target) in the Event and the status. Bounded
loops only: every wait polls with a deadline, nothing asserts how fast anything is.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from inflight.operator import admin_keys
from tests.operator.kmock_harness import OPERATOR_NAMESPACE, Cluster, running_operator, wait_for
from tests.operator.runtime_pods import runtime_processes, sync_pods

pytestmark = pytest.mark.slow

NAME = "ttft-e2e"
ROOT_KEY = b"ttft-e2e-root-key-0123456789abcdef"
ADMIN_KEY = admin_keys.derive(ROOT_KEY, "default", NAME)
PROMPT_TOKENS = 800  # of the tiny demo model's 1024 positions
NUM_CLIENTS = 3  # requests kept in flight: fewer than the queue target can ever see waiting
MAX_LOAD_REQUESTS = 400  # bounds the load loop however fast the engine is
TTFT_TARGET_S = 1.0
QUEUE_TARGET = 4
KV_TARGET = 0.8
# 2 ms per prompt token, 256 tokens a step: ~0.5 s a step, ~500 prompt tokens/s; three
# 800-token prompts are seconds of backlog.
SIM_PROFILE = {"base_ms": 1.0, "decode_row_ms": 0.1, "prefill_token_ms": 2.0, "attention_ms_per_1k_context": 0.0}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[int]]:
    """Two runtime processes on the simulated device with a slow prefill; yields their ports."""
    root = tmp_path_factory.mktemp("ttft")
    model = root / "demo"
    subprocess.run([sys.executable, "-m", "inflight.runtime.demo.model", str(model), "--size", "tiny"],
                   check=True, capture_output=True, timeout=120)
    profile = root / "slow-prefill.json"
    profile.write_text(json.dumps(SIM_PROFILE))
    args = ["--device", "sim", "--sim-profile", str(profile), "--num-kv-blocks", "1024", "--max-num-sequences", "8",
            "--max-num-batched-tokens", "256", "--enable-chunked-context", "--no-enable-prefix-caching"]
    with runtime_processes(model, root, args, ADMIN_KEY) as ports:
        yield ports


def _doc(ttft_target: float | None) -> dict[str, Any]:
    autoscaling: dict[str, Any] = {
        "enabled": True, "minReplicas": 1, "maxReplicas": 2,
        "targetKvCacheUsage": KV_TARGET, "targetQueueDepth": QUEUE_TARGET,
        "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 600, "intervalSeconds": 0.3,
    }
    if ttft_target is not None:
        autoscaling["targetTtftSeconds"] = ttft_target
    return {
        "apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": "default"},
        "spec": {
            "model": {"servedModelName": "demo", "hostPath": {"path": "/models/demo"}},
            "engine": {"maxNumSequences": 8, "maxNumTokens": 256, "enableChunkedContext": True},  # pushed live
            "resources": {"gpus": 0},
            "autoscaling": autoscaling,
        },
    }


async def _burst_until(port: int, enough: asyncio.Event) -> list[int]:
    """Keep NUM_CLIENTS long-prompt, one-token completions in flight until ``enough`` is set
    (at most MAX_LOAD_REQUESTS in all); HTTP statuses. Each prompt starts with its own token,
    so no prefix-cache hit shortens the work (the servers run without the cache anyway)."""
    statuses: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def client() -> None:
            while not enough.is_set() and len(statuses) < MAX_LOAD_REQUESTS:
                first = 10 + len(statuses) % 900
                prompt = [first] + [(first + i) % 1000 + 10 for i in range(PROMPT_TOKENS - 1)]
                body = {"model": "demo", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    await resp.read()
                    statuses.append(resp.status)

        await asyncio.gather(*(client() for _ in range(NUM_CLIENTS)))
    return statuses


async def _kubelet(cluster: Cluster, ports: list[int], seen: dict[str, Any], stop: asyncio.Event) -> None:
    """Keep pod objects in line with the Deployment's replicas; record replicas and the
    decisions the status shows (message with the KV usage and queue depth it saw)."""
    while not stop.is_set():
        replicas = await sync_pods(cluster, NAME, ports)
        cr = await cluster.cr(NAME)
        if replicas is not None:
            seen["replicas"].append(replicas)
        status = (cr or {}).get("status") or {}
        message = status.get("lastDecisionMessage")
        if message and (not seen["decisions"] or seen["decisions"][-1][1] != message):
            seen["decisions"].append((status.get("lastDecisionReason"), message, status.get("kvCacheUsage")))
        await asyncio.sleep(0.1)


async def _pod_backlog_seconds(port: int) -> float | None:
    """The pod's own TTFT backlog from its /metrics (None before it measured a rate)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics", headers=headers) as resp:
            text = await resp.text()
    values = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^inflight:(num_prefill_backlog_tokens|prefill_tokens_per_second)\{[^}]*\} (\S+)$', text, re.M)}
    rate = values.get("prefill_tokens_per_second", 0.0)
    return values.get("num_prefill_backlog_tokens", 0.0) / rate if rate > 0 else None


async def _replicas(cluster: Cluster, value: int) -> bool:
    deploy = await cluster.child("deployments", NAME)
    return bool(deploy and deploy["spec"].get("replicas") == value)


async def _scale_events(cluster: Cluster) -> list[tuple[str, str]]:
    events = await cluster.get("/api/v1/namespaces/default/events") or {}
    return [(e["reason"], e["message"]) for e in events.get("items", [])
            if e.get("source", {}).get("component") == "inflight-operator" and e["reason"].startswith("Scale")]


def _signal(message: str, name: str) -> tuple[float, float]:
    """(value, target) of one signal in a decision message, e.g. 'kv 0.12/0.8'."""
    match = re.search(rf"{name} ([0-9.]+)s?/([0-9.]+)", message)
    assert match, (name, message)
    return float(match.group(1)), float(match.group(2))


async def _run(servers: list[int], ttft_target: float | None, seen: dict[str, Any],
               until: Any) -> tuple[list[int], list[tuple[str, str]], dict[str, Any]]:
    """Create the CR, start the burst on pod 0, wait for ``until(cluster)``; (statuses, scale
    events, the CR at the end)."""
    async with running_operator(tick_seconds=0.2) as cluster:
        root = {"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "inflight-operator-root-key", "namespace": OPERATOR_NAMESPACE},
                "data": {admin_keys.ROOT_KEY: base64.b64encode(ROOT_KEY).decode()}}
        await cluster.create(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/secrets", root)
        await cluster.create_cr(_doc(ttft_target))
        await wait_for(lambda: _replicas(cluster, 1), timeout=10, what="Deployment with 1 replica")
        stop = asyncio.Event()
        kubelet = asyncio.create_task(_kubelet(cluster, servers, seen, stop))
        enough = asyncio.Event()
        load = asyncio.create_task(_burst_until(servers[0], enough))
        try:
            await until(cluster)
        finally:
            enough.set()
            statuses = await asyncio.wait_for(load, 120)
            stop.set()
            await kubelet
        return statuses, await _scale_events(cluster), await cluster.cr(NAME) or {}


def test_without_a_ttft_target_the_burst_does_not_scale(servers: list[int]) -> None:
    """KV usage and queue depth alone: the operator sees the burst and holds at 1."""
    async def scenario() -> None:
        seen: dict[str, Any] = {"replicas": [], "decisions": []}

        async def burst_seen(cluster: Cluster) -> None:
            # The pod itself reports seconds of backlog well past the target the other test sets ...
            await wait_for(lambda: _over(servers[0], 1.5 * TTFT_TARGET_S), timeout=60,
                           what="the pod's own TTFT backlog well past the target")

            before = len(seen["decisions"])

            async def decided_under_load() -> bool:  # ... and the operator decides on it, repeatedly
                return len([d for d in seen["decisions"][before:] if (d[2] or 0) > 0]) >= 5

            try:
                await wait_for(decided_under_load, timeout=60, what="five decisions taken during the burst")
            except AssertionError as err:
                raise AssertionError(f"{err}; the decisions seen: {seen['decisions'][-8:]}") from None

        statuses, events, _ = await _run(servers, None, seen, burst_seen)
        assert statuses and set(statuses) == {200}, statuses
        assert set(seen["replicas"]) == {1}, seen["replicas"]
        assert events == [], events
        busy = [d for d in seen["decisions"] if (d[2] or 0) > 0]
        for reason, message, kv in busy:
            assert not reason.startswith("ScaleUp"), (reason, message)
            assert kv < KV_TARGET and _signal(message, "queue")[0] < QUEUE_TARGET, message
            assert "ttft" not in message, message

    asyncio.run(asyncio.wait_for(scenario(), 200))


async def _over(port: int, seconds: float) -> bool:
    backlog = await _pod_backlog_seconds(port)
    return backlog is not None and backlog > seconds


def test_the_ttft_target_scales_up_on_the_same_burst(servers: list[int]) -> None:
    async def scenario() -> None:
        seen: dict[str, Any] = {"replicas": [], "decisions": []}

        async def scaled(cluster: Cluster) -> None:
            await wait_for(lambda: _replicas(cluster, 2), timeout=60, what="scale-up to 2 on the TTFT backlog")
            await wait_for(lambda: _scale_events(cluster), timeout=15, what="the scale-up Event")

        statuses, events, cr = await _run(servers, TTFT_TARGET_S, seen, scaled)
        assert statuses and set(statuses) == {200}, statuses
        assert seen["replicas"][0] == 1 and max(seen["replicas"]) == 2
        reason, message = events[0]
        assert reason == "ScaleUpTtft" and "scaled 1 -> 2" in message, events
        assert "by Ttft" in message, message
        backlog, target = _signal(message, "ttft backlog")
        assert target == TTFT_TARGET_S and backlog > target * 1.1, message
        kv, kv_target = _signal(message, "kv")
        assert kv < kv_target == KV_TARGET, message  # KV usage alone would not have scaled
        assert _signal(message, "queue")[0] < QUEUE_TARGET, message
        recommendations = cr["status"]["recommendations"]
        assert any(r.get("reason") == "ScaleUpTtft" and "by Ttft" in r.get("message", "")
                   for r in recommendations), recommendations

    asyncio.run(asyncio.wait_for(scenario(), 200))
