"""kopf + our handlers against the kmock API emulator: children, status, live retune, delete, errors."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import logging
from typing import Any

import pytest

from inflight.operator import render
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import FakePod, pod_object, running_operator, wait_for

CHILDREN = ("deployments", "services", "poddisruptionbudgets", "configmaps")


def _child_name(kind: str, name: str) -> str:
    return render.configmap_name(name) if kind == "configmaps" else name


def _condition(cr: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for cond in ((cr or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return cond
    return None


def test_each_example_creates_owned_children_and_status() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            for path in EXAMPLES:
                await cluster.create_cr(load_example(path))
            for path in EXAMPLES:
                name = load_example(path)["metadata"]["name"]
                cr = await wait_for(
                    lambda n=name: _status_ready(cluster, n), what=f"{name} reconciled")
                uid = cr["metadata"]["uid"]
                for kind in CHILDREN:
                    child = await cluster.child(kind, _child_name(kind, name))
                    assert child is not None, f"{kind} of {name} missing"
                    owner = child["metadata"]["ownerReferences"][0]
                    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
                        "InferenceDeployment", name, uid, True)
                assert cr["status"]["observedGeneration"] == 1
                assert cr["status"]["selector"] == render.selector_string(name)
                assert _condition(cr, "Degraded")["status"] == "False"
                assert _condition(cr, "Progressing")["status"] == "True"

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _status_ready(cluster: Any, name: str) -> dict[str, Any] | None:
    cr = await cluster.cr(name)
    return cr if cr and (cr.get("status") or {}).get("observedGeneration") else None


def _tuned_doc() -> dict[str, Any]:
    doc = copy.deepcopy(load_example(next(p for p in EXAMPLES if p.stem == "tuned")))
    doc["spec"]["replicas"] = 2
    return doc


def test_live_knob_edit_reaches_pods_without_rollout_and_dtype_rolls(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        pods = [await FakePod().start() for _ in range(2)]
        try:
            async with running_operator() as cluster:
                secret = {"apiVersion": "v1", "kind": "Secret",
                          "metadata": {"name": "inflight-api-key", "namespace": "default"},
                          "data": {"api-key": base64.b64encode(b"s3cret").decode()}}
                await cluster.create("/api/v1/namespaces/default/secrets", secret)
                for i, pod in enumerate(pods):
                    await cluster.create("/api/v1/namespaces/default/pods",
                                         pod_object(f"qwen-tuned-{i}", "qwen-tuned", pod.port))
                await cluster.create_cr(_tuned_doc())
                await wait_for(lambda: _all_posted(pods, 128), what="initial live config on both pods")
                before = await cluster.child("deployments", "qwen-tuned")

                admin = await _admin_key(cluster, "qwen-tuned")
                seen["admin"] = admin
                assert admin and admin != "s3cret" and len(admin) >= 32

                await cluster.patch_cr("qwen-tuned", {"spec": {"engine": {"maxNumSequences": 99}}})
                await wait_for(lambda: _all_posted(pods, 99), what="maxNumSequences=99 pushed to both pods")
                # Live pushes carry the admin credential, never the inference key; it is not rotated.
                assert all(p.admin_posts[-1][1] == f"Bearer {admin}" for p in pods)
                assert await _admin_key(cluster, "qwen-tuned") == admin
                assert pods[0].admin_posts[-1][0] == {"max_num_sequences": 99, "max_num_tokens": 4096,
                                                       "max_queue_len": 512}
                cm = await cluster.child("configmaps", "qwen-tuned-live-config")
                assert cm["data"]["max_num_sequences"] == "99"  # new pods start with it
                after = await cluster.child("deployments", "qwen-tuned")
                assert after["spec"]["template"] == before["spec"]["template"]  # no rollout
                cr = await wait_for(lambda: _generation_observed(cluster, "qwen-tuned", 2), what="gen 2")
                assert cr["metadata"]["generation"] == 2

                await cluster.patch_cr("qwen-tuned", {"spec": {"engine": {"dtype": "float16"}}})
                rolled = await wait_for(lambda: _dtype_in_template(cluster, "float16"), what="dtype rollout")
                assert rolled["spec"]["template"] != before["spec"]["template"]
                await wait_for(lambda: _generation_observed(cluster, "qwen-tuned", 3), what="gen 3")
                seen["status"] = json.dumps((await cluster.cr("qwen-tuned"))["status"])
        finally:
            for pod in pods:
                await pod.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    # Neither key reaches the operator's logs (kopf's and ours, DEBUG included) or the status.
    for secret in (seen["admin"], "s3cret"):
        assert secret not in caplog.text and secret not in seen["status"]
    assert "pushed to pod" in caplog.text  # the logs were captured


async def _admin_key(cluster: Any, name: str) -> str | None:
    secret = await cluster.get(f"/api/v1/namespaces/default/secrets/{name}-admin")
    return base64.b64decode(secret["data"]["admin-api-key"]).decode() if secret else None


async def _all_posted(pods: list[FakePod], value: int) -> bool:
    return all(p.admin_posts and p.admin_posts[-1][0].get("max_num_sequences") == value for p in pods)


async def _generation_observed(cluster: Any, name: str, gen: int) -> dict[str, Any] | None:
    cr = await cluster.cr(name)
    return cr if cr and (cr.get("status") or {}).get("observedGeneration") == gen else None


async def _dtype_in_template(cluster: Any, dtype: str) -> dict[str, Any] | None:
    deploy = await cluster.child("deployments", "qwen-tuned")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    return deploy if "--dtype" in args and args[args.index("--dtype") + 1] == dtype else None


def test_invalid_resource_is_degraded_without_hot_retry_then_recovers() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = {"apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
                   "metadata": {"name": "bad", "namespace": "default"},
                   "spec": {"model": {"hostPath": {"path": "/m"}}, "engine": {"blockSize": 12}}}
            await cluster.create_cr(doc)

            async def degraded() -> dict[str, Any] | None:
                cond = _condition(await cluster.cr("bad"), "Degraded")
                return cond if cond and cond["status"] == "True" else None

            cond = await wait_for(degraded, what="Degraded=True")
            assert cond["reason"] == "InvalidSpec"
            assert "block_size must be a power of two" in cond["message"]
            patches = cluster.requests_to("PATCH", "/inferencedeployments/bad")
            await asyncio.sleep(2.0)  # many timer ticks: no retry storm
            assert cluster.requests_to("PATCH", "/inferencedeployments/bad") - patches <= 2
            assert await cluster.child("deployments", "bad") is None

            await cluster.patch_cr("bad", {"spec": {"engine": {"blockSize": 16}}})

            async def recovered() -> bool:
                cond = _condition(await cluster.cr("bad"), "Degraded")
                return bool(cond and cond["status"] == "False")

            await wait_for(recovered, what="Degraded=False after the fix")
            assert await cluster.child("deployments", "bad") is not None

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_delete_removes_children_and_releases_the_resource() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = load_example(next(p for p in EXAMPLES if p.stem == "minimal"))
            await cluster.create_cr(doc)
            await wait_for(lambda: cluster.child("poddisruptionbudgets", "llama-minimal"), what="children")
            cr = await cluster.cr("llama-minimal")
            assert "inflight.dev/finalizer" in cr["metadata"]["finalizers"]
            await cluster.request("DELETE", "/apis/inflight.dev/v1alpha1/namespaces/default/"
                                  "inferencedeployments/llama-minimal")

            async def gone() -> bool:
                return await cluster.cr("llama-minimal") is None

            await wait_for(gone, what="resource released (finalizer removed)")
            for kind in CHILDREN:
                assert await cluster.child(kind, _child_name(kind, "llama-minimal")) is None, kind

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_pod_that_becomes_ready_later_gets_the_live_config_from_the_timer() -> None:
    async def scenario() -> None:
        pod = await FakePod().start()
        try:
            async with running_operator() as cluster:
                doc = load_example(next(p for p in EXAMPLES if p.stem == "minimal"))
                doc["spec"]["engine"] = {"maxQueueLen": 5}
                await cluster.create_cr(doc)
                await wait_for(lambda: cluster.child("deployments", "llama-minimal"), what="deployment")
                path = "/api/v1/namespaces/default/pods"
                await cluster.create(path, pod_object("llama-minimal-0", "llama-minimal", pod.port, ready=False))
                await asyncio.sleep(1.0)
                assert pod.admin_posts == []  # not ready: nothing pushed
                ready = {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}
                await cluster.request("PATCH", f"{path}/llama-minimal-0", ready, merge=True)
                await wait_for(lambda: _all_posted_queue(pod, 5), what="timer pushed live config")
                await asyncio.sleep(1.0)
                assert len(pod.admin_posts) == 1  # pushed once, not every tick
        finally:
            await pod.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _all_posted_queue(pod: FakePod, value: int) -> bool:
    return bool(pod.admin_posts) and pod.admin_posts[-1][0].get("max_queue_len") == value


def test_autoscaling_with_fake_pods_scales_up_and_down_and_posts_events() -> None:
    async def scenario() -> None:
        pods = [await FakePod(kv_cache_usage=0.9, num_waiting=10).start() for _ in range(3)]
        try:
            async with running_operator() as cluster:
                doc = load_example(next(p for p in EXAMPLES if p.stem == "autoscaled"))
                doc["spec"]["autoscaling"].update(
                    maxReplicas=3, intervalSeconds=0.2, scaleDownStabilizationSeconds=1.0)
                await cluster.create_cr(doc)
                name, path = "mistral-autoscaled", "/api/v1/namespaces/default/pods"
                await wait_for(lambda: cluster.child("deployments", name), what="deployment")
                for i, pod in enumerate(pods):
                    await cluster.create(path, pod_object(f"{name}-{i}", name, pod.port))
                await wait_for(lambda: _deploy_replicas(cluster, name, 3), what="scale up to max 3")

                async def observed() -> dict[str, Any] | None:
                    cr = await cluster.cr(name)
                    return cr if (cr or {}).get("status", {}).get("kvCacheUsage") is not None else None

                cr = await wait_for(observed, what="observed KV usage in status")
                assert cr["status"]["kvCacheUsage"] == pytest.approx(0.9)
                assert cr["status"]["queueDepth"] == pytest.approx(10.0)
                for pod in pods:
                    pod.kv_cache_usage, pod.num_waiting = 0.0, 0.0
                await wait_for(lambda: _deploy_replicas(cluster, name, 1), what="scale down to min 1")
                async def scaled_down_event() -> list[str] | None:  # posted right after the Deployment patch
                    events = (await cluster.get("/api/v1/namespaces/default/events"))["items"]
                    reasons = [e["reason"] for e in events if e["source"]["component"] == "inflight-operator"]
                    return reasons if reasons and reasons[-1] == "ScaleDown" else None

                reasons = await wait_for(scaled_down_event, what="the ScaleDown event")
                assert reasons[0] == "ScaleUpQueue", reasons

                async def settled() -> dict[str, Any] | None:  # the tick that scaled patches status last
                    cr = await cluster.cr(name)
                    reason = cr["status"].get("lastDecisionReason")
                    return cr if reason in ("ScaleDown", "ClampedMin", "Steady") else None

                cr = await wait_for(settled, what="status after the scale-down")
                assert cr["status"]["lastScaleTime"]
        finally:
            for pod in pods:
                await pod.stop()

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def _deploy_replicas(cluster: Any, name: str, value: int) -> bool:
    deploy = await cluster.child("deployments", name)
    return bool(deploy and deploy["spec"].get("replicas") == value)
