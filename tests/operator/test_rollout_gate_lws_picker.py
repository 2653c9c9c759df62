"""The rollout gate over a multi-node model's LeaderWorkerSet and over the endpoint picker's Deployment.

Pure parts by table (an LWS's held part, when an LWS is rolled out); then kmock with our kopf
operator, two models under maxConcurrentRollouts 1: a new runtime image default rolls one LWS,
the other waits (RolloutPending naming it) until the first one's groups are ready at the new
generation; a new runtime and picker image default rolls one model's Deployment and picker as
one slot, held until both are rolled out, the other model's Deployment and picker keeping
theirs meanwhile. State is read in-process from the emulator's store (no polling over HTTP).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from inflight.operator import applied, lws_status, render_pool, rollout_gate
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import (
    Cluster,
    OperatorProcess,
    api_server,
    start_operator,
    ticks,
    uncovered_requests,
    wait_for,
)
from tests.operator.lws_controller import LWS_PATH, install_lws

DEPLOYS = "/apis/apps/v1/namespaces/default/deployments"
IMAGE_ENV, PICKER_ENV = "INFLIGHT_OPERATOR_RUNTIME_IMAGE", "INFLIGHT_OPERATOR_PICKER_IMAGE"
OLD, NEW = "registry.local/runtime:1", "registry.local/runtime:2"
PICKER_OLD, PICKER_NEW = "registry.local/epp:1", "registry.local/epp:2"
PATIENCE_S = 60.0  # every wait's bound: it guards against a hang, never a claim about speed
FULL_CHECK_EVERY = 2


# -- pure parts --------------------------------------------------------------------------------


def _lws(leader_image: str, generation: str | None) -> dict[str, Any]:
    lwt = {"size": 2, "leaderTemplate": {"spec": {"containers": [{"name": "runtime", "image": leader_image}]}},
           "workerTemplate": {"spec": {"containers": [{"name": "runtime", "image": leader_image}]}}}
    patch = {"metadata": {"name": "m"}, "spec": {"replicas": 1, "leaderWorkerTemplate": lwt}}
    annotations = {applied.ANNOTATION: applied.record(patch)}
    if generation is not None:
        annotations[rollout_gate.GENERATION_ANNOTATION] = generation
    return {"metadata": {"name": "m", "annotations": annotations}, "spec": copy.deepcopy(patch["spec"])}


@pytest.mark.parametrize(("live", "generation", "held"), [
    (_lws(OLD, "3"), 3, True),  # same generation, new leader/worker templates: the operator's change
    (_lws(OLD, None), 3, True),  # written by an older operator
    (_lws(OLD, "2"), 3, False),  # the user's edit
    (_lws(NEW, "3"), 3, False),  # nothing changed
])
def test_an_lws_template_change_is_held_like_a_deployments(live: dict[str, Any], generation: int, held: bool) -> None:
    rendered = rollout_gate.gated_part(_lws(NEW, None))
    old = rollout_gate.held_template(live, rendered, generation)
    assert (old is not None) is held
    if held:
        assert old == rollout_gate.gated_part(live)
        kept = rollout_gate.with_hold(_lws(NEW, None), rollout_gate.Hold(generation, old))
        assert kept["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["image"] == OLD
        assert kept["metadata"]["annotations"][rollout_gate.GENERATION_ANNOTATION] == str(generation)


@pytest.mark.parametrize(("status", "replicas", "since", "done"), [
    ({"observedGeneration": 4, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}, 2, 4, True),
    ({"observedGeneration": 3, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 2}, 2, 4, False),  # not seen
    ({"observedGeneration": 4, "replicas": 2, "updatedReplicas": 1, "readyReplicas": 2}, 2, 4, False),  # old group
    ({"observedGeneration": 4, "replicas": 2, "updatedReplicas": 2, "readyReplicas": 1}, 2, 4, False),  # not ready
    ({"observedGeneration": 4, "replicas": 3, "updatedReplicas": 2, "readyReplicas": 3}, 2, 4, False),  # one old left
    ({}, 1, 1, False),
])
def test_an_lws_is_rolled_out_when_its_groups_are_ready_at_the_new_generation(
        status: dict[str, Any], replicas: int, since: int, done: bool) -> None:
    assert lws_status.rolled_out({"spec": {"replicas": replicas}, "status": status}, since) is done


# -- in the emulator ---------------------------------------------------------------------------


def _stored(cluster: Cluster, plural: str, name: str) -> dict[str, Any] | None:
    for (res, namespace, stored_name), obj in cluster.api.objects.items():
        if res.plural == plural and namespace == "default" and stored_name == name and not obj.deleted:
            return obj.raw
    return None


def _lws_image(cluster: Cluster, name: str) -> str | None:
    lws = _stored(cluster, "leaderworkersets", name)
    if lws is None:
        return None
    lwt = lws["spec"]["leaderWorkerTemplate"]
    images = {lwt[k]["spec"]["containers"][0]["image"] for k in ("leaderTemplate", "workerTemplate")}
    assert len(images) == 1, images  # leader and workers roll together
    return images.pop()


def _image(cluster: Cluster, name: str) -> str | None:
    dep = _stored(cluster, "deployments", name)
    return dep["spec"]["template"]["spec"]["containers"][0]["image"] if dep else None


def _pending(cluster: Cluster, name: str) -> dict[str, Any] | None:
    cr = _stored(cluster, "inferencedeployments", name)
    return next((c for c in ((cr or {}).get("status") or {}).get("conditions") or []
                 if c["type"] == "RolloutPending"), None)


def _waiting_on(cluster: Cluster, name: str, other: str) -> bool:
    cond = _pending(cluster, name)
    return bool(cond and cond["status"] == "True" and cond["reason"] == "WaitingForRolloutSlot"
                and f"default/{other}" in cond["message"])


def _released(cluster: Cluster, name: str) -> bool:
    cond = _pending(cluster, name)
    return bool(cond and cond["status"] == "False" and cond["reason"] == "NoPendingRollout")


async def _until(check: Any, what: str) -> None:
    async def holds() -> bool:
        return bool(check())

    await wait_for(holds, timeout=PATIENCE_S, what=what)


async def _full_checks(models: int) -> None:
    """Until every model's timer could make two more full checks (rounds counted, not seconds)."""
    until = ticks() + models * (2 * FULL_CHECK_EVERY + 1)
    await _until(lambda: ticks() >= until, "more operator timer rounds")


async def _start(cluster: Cluster) -> OperatorProcess:
    op = start_operator(cluster, tick_seconds=0.3, full_check_every_ticks=FULL_CHECK_EVERY, max_concurrent_rollouts=1)
    await asyncio.wait_for(op.ready.wait(), 10)
    return op


async def _roll_out_lws(cluster: Cluster, name: str) -> None:
    """LWS's controller: every group of the current generation ready."""
    lws = _stored(cluster, "leaderworkersets", name)
    groups = lws["spec"].get("replicas", 1)
    await cluster.request("PATCH", f"{LWS_PATH.format(ns='default')}/{name}/status", {"status": {
        "observedGeneration": lws["metadata"]["generation"], "replicas": groups, "updatedReplicas": groups,
        "readyReplicas": groups}}, merge=True)


async def _roll_out(cluster: Cluster, name: str) -> None:
    """The Deployment controller and kubelet: the current generation rolled out and available."""
    dep = _stored(cluster, "deployments", name)
    want = dep["spec"].get("replicas", 1)
    await cluster.request("PATCH", f"{DEPLOYS}/{name}/status", {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": want, "updatedReplicas": want,
        "readyReplicas": want, "availableReplicas": want}}, merge=True)


def _multi_node(name: str) -> dict[str, Any]:
    return {"apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"model": {"servedModelName": name, "pvc": {"claimName": "models", "path": name}},
                     "resources": {"gpus": 8}, "nodes": 2}}


def test_a_new_operator_version_rolls_one_leader_worker_set_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["big-0", "big-1"]
    monkeypatch.setenv(IMAGE_ENV, OLD)

    async def scenario() -> None:
        async with api_server() as cluster:
            await install_lws(cluster)
            op = await _start(cluster)  # the previous operator version: created, rolled out
            for name in names:
                await cluster.create_cr(_multi_node(name))
            for name in names:
                await _until(lambda n=name: _lws_image(cluster, n) == OLD, f"{name} LWS on the old image")
                await _roll_out_lws(cluster, name)
            await op.shutdown()

            monkeypatch.setenv(IMAGE_ENV, NEW)  # the upgrade: a new default runtime image
            op = await _start(cluster)
            try:
                def on_new() -> list[str]:
                    return [n for n in names if _lws_image(cluster, n) == NEW]

                await _until(lambda: len(on_new()) == 1, "one LWS rolling")
                (first,) = on_new()
                (second,) = [n for n in names if n != first]
                await _until(lambda: _waiting_on(cluster, second, first), f"{second} RolloutPending naming {first}")
                await _full_checks(len(names))
                assert on_new() == [first]  # its groups are not ready at the new generation yet

                await _roll_out_lws(cluster, first)
                await _until(lambda: _lws_image(cluster, second) == NEW, f"{second} rolling once {first} is ready")
                await _until(lambda: _released(cluster, second), f"{second} no longer pending")
            finally:
                await op.shutdown()
            assert not uncovered_requests(cluster.api), uncovered_requests(cluster.api)

    asyncio.run(asyncio.wait_for(scenario(), 4 * PATIENCE_S))


def _pooled(name: str) -> dict[str, Any]:
    doc = copy.deepcopy(load_example(next(p for p in EXAMPLES if p.stem == "minimal")))
    doc["metadata"]["name"] = name
    doc["spec"]["inferencePool"] = {"enabled": True}
    return doc


def _picker_image(cluster: Cluster, name: str) -> str | None:
    return _image(cluster, render_pool.picker_name(name))


def test_a_new_picker_image_default_rolls_with_its_model_in_one_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new runtime and picker image default: one model's Deployment and picker roll; the other
    model keeps both until the first model's Deployment *and* picker are rolled out."""
    names = ["pool-0", "pool-1"]
    monkeypatch.setenv(IMAGE_ENV, OLD)
    monkeypatch.setenv(PICKER_ENV, PICKER_OLD)

    async def scenario() -> None:
        async with api_server() as cluster:
            op = await _start(cluster)
            for name in names:
                await cluster.create_cr(_pooled(name))
            for name in names:
                await _until(lambda n=name: _image(cluster, n) == OLD and _picker_image(cluster, n) == PICKER_OLD,
                             f"{name} and its picker on the old images")
                await _roll_out(cluster, name)
                await _roll_out(cluster, render_pool.picker_name(name))
            await op.shutdown()

            monkeypatch.setenv(IMAGE_ENV, NEW)
            monkeypatch.setenv(PICKER_ENV, PICKER_NEW)
            op = await _start(cluster)
            try:
                def on_new() -> list[str]:
                    return [n for n in names if _picker_image(cluster, n) == PICKER_NEW]

                await _until(lambda: len(on_new()) == 1, "one model's picker rolling")
                (first,) = on_new()
                (second,) = [n for n in names if n != first]
                await _until(lambda: _image(cluster, first) == NEW, f"{first}'s Deployment rolling with its picker")
                await _until(lambda: _waiting_on(cluster, second, first), f"{second} RolloutPending naming {first}")

                await _roll_out(cluster, first)  # the model is rolled out, its picker not yet: the slot is held
                await _full_checks(len(names))
                assert (_image(cluster, second), _picker_image(cluster, second)) == (OLD, PICKER_OLD)
                assert _waiting_on(cluster, second, first)

                await _roll_out(cluster, render_pool.picker_name(first))
                await _until(lambda: _picker_image(cluster, second) == PICKER_NEW and _image(cluster, second) == NEW,
                             f"{second} and its picker rolling once {first}'s picker is available")
                await _until(lambda: _released(cluster, second), f"{second} no longer pending")
            finally:
                await op.shutdown()
            assert not uncovered_requests(cluster.api), uncovered_requests(cluster.api)

    asyncio.run(asyncio.wait_for(scenario(), 4 * PATIENCE_S))
