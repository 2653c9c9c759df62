"""The rollout gate: pod-template changes the operator causes roll at most N models at a time.

Pure parts by table (what is a gated change, when a Deployment is rolled out, the setting); then
kmock with our kopf operator: a new operator version (a new runtime image default, as the chart's
upgrade sets it) over 3 models rolls at most 1 at a time through an operator restart and every
model rolls in the end, a user's edit is never gated, and ``manual`` waits for the approval
annotation, which is then removed.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import kopf
import pytest

from inflight.operator import applied, rollout_gate
from inflight.operator.context import OperatorConfig, OperatorContext
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import (
    OPERATOR_NAMESPACE,
    Cluster,
    OperatorProcess,
    api_server,
    start_operator,
    ticks,
    uncovered_requests,
    wait_for,
)

DEPLOYS = "/apis/apps/v1/namespaces/default/deployments"
IMAGE_ENV = "INFLIGHT_OPERATOR_RUNTIME_IMAGE"
OLD, NEW = "registry.local/runtime:1", "registry.local/runtime:2"


def _live(template: dict[str, Any], generation: str | None) -> dict[str, Any]:
    patch = {"metadata": {"name": "m"}, "spec": {"replicas": 1, "template": template}}
    annotations = {applied.ANNOTATION: applied.record(patch)}
    if generation is not None:
        annotations[rollout_gate.GENERATION_ANNOTATION] = generation
    return {"metadata": {"name": "m", "annotations": annotations}, "spec": copy.deepcopy(patch["spec"])}


T1 = {"spec": {"containers": [{"name": "runtime", "image": OLD}]}}
T2 = {"spec": {"containers": [{"name": "runtime", "image": NEW}]}}


@pytest.mark.parametrize(("live", "rendered", "generation", "held"), [
    (None, T2, 3, None),  # nothing to roll: it is created
    (_live(T1, "3"), T1, 3, None),  # same template
    (_live(T1, "3"), {"spec": {**T1["spec"], "nodeSelector": None}}, 3, None),  # a merge patch's null is no change
    (_live(T1, "3"), T2, 3, T1),  # same generation, new template: the operator's change
    (_live(T1, None), T2, 3, T1),  # written by an older operator (no generation): the operator's change
    (_live(T1, "2"), T2, 3, None),  # the user's edit: never gated
    (_live(T1, "3"), T2, None, None),  # no generation known: nothing gated
    ({"metadata": {"name": "m"}, "spec": {"template": T1}}, T2, 3, None),  # no record: not the operator's
])
def test_held_template_tells_the_operators_change_from_a_users_edit(live, rendered, generation, held) -> None:
    assert rollout_gate.held_template(live, rendered, generation) == held


def _deploy(want: int, generation_seen: int, **status: int) -> dict[str, Any]:
    return {"spec": {"replicas": want}, "status": {"observedGeneration": generation_seen, **status}}


@pytest.mark.parametrize(("deployment", "since", "done"), [
    (_deploy(2, 4, replicas=2, updatedReplicas=2, availableReplicas=2), 4, True),
    (_deploy(2, 3, replicas=2, updatedReplicas=2, availableReplicas=2), 4, False),  # not observed yet
    (_deploy(2, 4, replicas=3, updatedReplicas=2, availableReplicas=2), 4, False),  # an old pod left
    (_deploy(2, 4, replicas=2, updatedReplicas=2, availableReplicas=1), 4, False),  # not available
    (_deploy(2, 5, replicas=2, updatedReplicas=2, availableReplicas=2), 4, True),  # a later generation
    (_deploy(0, 4), 4, True),  # scaled to zero
    ({"spec": {"replicas": 1}}, 1, False),  # no status at all
])
def test_rolled_out_reads_a_deployment_as_kubectl_rollout_status_does(deployment, since, done) -> None:
    assert rollout_gate.rolled_out(deployment, since) is done


def test_the_setting_is_a_count_manual_or_unlimited() -> None:
    assert rollout_gate.parse_limit("3") == 3
    assert rollout_gate.parse_limit(" Manual ") == "manual"
    assert rollout_gate.parse_limit("unlimited") == "unlimited"
    for bad in ("0", "-1", "two", "", True, 0):
        with pytest.raises(ValueError, match="maxConcurrentRollouts"):
            rollout_gate.parse_limit(bad)
    assert OperatorConfig.from_env({}).max_concurrent_rollouts == 1
    assert OperatorConfig.from_env({"INFLIGHT_OPERATOR_MAX_CONCURRENT_ROLLOUTS": "manual"}).max_concurrent_rollouts \
        == "manual"
    with pytest.raises(ValueError, match="INFLIGHT_OPERATOR_MAX_CONCURRENT_ROLLOUTS"):
        OperatorConfig.from_env({"INFLIGHT_OPERATOR_MAX_CONCURRENT_ROLLOUTS": "0"})


def test_the_waiting_message_names_the_models_holding_the_slots_and_the_way_out() -> None:
    gate = rollout_gate.waiting_gate(2, [f"ns/m{i}" for i in range(7)])
    assert gate.waiting and gate.reason == "WaitingForRolloutSlot"
    assert "ns/m0" in gate.message and "2 more" in gate.message and "inflight.dev/rollout=approved" in gate.message
    cond = rollout_gate.pending_condition(rollout_gate.waiting_gate("manual", []))
    assert (cond.status, cond.reason) == (True, "AwaitingApproval")
    assert rollout_gate.pending_condition(None).status is False


# -- in the emulator ---------------------------------------------------------------------------


PATIENCE_S = 90.0  # every wait's bound: it guards against a hang, never a claim about speed
FULL_CHECK_EVERY = 2  # operator timer rounds per full check (a waiting rollout asks again at one)


def _wait(check: Any, what: str) -> Any:
    """``wait_for`` with room for a loaded machine (the bound only guards against a hang)."""
    return wait_for(check, timeout=PATIENCE_S, what=what)


def _doc(name: str) -> dict[str, Any]:
    doc = copy.deepcopy(load_example(next(p for p in EXAMPLES if p.stem == "minimal")))
    doc["metadata"]["name"] = name
    return doc


async def _image(cluster: Cluster, name: str) -> str | None:
    dep = await cluster.child("deployments", name)
    return dep["spec"]["template"]["spec"]["containers"][0]["image"] if dep else None


async def _roll_out(cluster: Cluster, name: str) -> None:
    """The Deployment controller and kubelet: the current generation rolled out and available."""
    dep = await cluster.child("deployments", name)
    await cluster.request("PATCH", f"{DEPLOYS}/{name}/status", {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": 1, "updatedReplicas": 1,
        "readyReplicas": 1, "availableReplicas": 1}}, merge=True)


def _cond(cr: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    return next((c for c in ((cr or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


async def _pending(cluster: Cluster, name: str, reason: str) -> bool:
    cond = _cond(await cluster.cr(name), "RolloutPending")
    return bool(cond and cond["status"] == "True" and cond["reason"] == reason)


async def _start(cluster: Cluster, limit: int | str) -> OperatorProcess:
    op = start_operator(cluster, tick_seconds=0.3, full_check_every_ticks=FULL_CHECK_EVERY,
                        max_concurrent_rollouts=limit)
    await asyncio.wait_for(op.ready.wait(), 10)
    return op


async def _fleet_on_old_image(cluster: Cluster, names: list[str], limit: int | str) -> None:
    """The models as the previous operator version left them: created, rolled out."""
    op = await _start(cluster, limit)
    for name in names:
        await cluster.create_cr(_doc(name))
    for name in names:
        await _until(lambda n=name: _image_now(cluster, n) == OLD, f"{name} on the old image")
        await _roll_out(cluster, name)
    await op.shutdown()


async def _image_is(cluster: Cluster, name: str, image: str) -> bool:
    return await _image(cluster, name) == image


async def _on_new(cluster: Cluster, names: list[str]) -> list[str]:
    return [n for n in names if await _image(cluster, n) == NEW]


def _stored(cluster: Cluster, plural: str, name: str, ns: str = "default") -> dict[str, Any] | None:
    """The emulator's stored object, read in-process (the scenario polls it every 50 ms; in-process
    reads add nothing to the request log the RBAC check reads at the end)."""
    for (res, namespace, stored_name), obj in cluster.api.objects.items():
        if res.plural == plural and namespace == ns and stored_name == name and not obj.deleted:
            return obj.raw
    return None


def _image_now(cluster: Cluster, name: str) -> str | None:
    dep = _stored(cluster, "deployments", name)
    return dep["spec"]["template"]["spec"]["containers"][0]["image"] if dep else None


def _pending_now(cluster: Cluster, name: str, reason: str | None) -> bool:
    """RolloutPending is True with ``reason`` (``None``: it is not True: never held, or released)."""
    cond = _cond(_stored(cluster, "inferencedeployments", name), "RolloutPending")
    if reason is None:
        return cond is None or cond["status"] == "False"
    return bool(cond and cond["status"] == "True" and cond["reason"] == reason)


async def _until(check: Any, what: str) -> None:
    """Until ``check()`` (an in-process read) holds; the bound only guards against a hang."""
    async def holds() -> bool:
        return bool(check())

    await wait_for(holds, timeout=PATIENCE_S, what=what)


async def _full_checks(models: int) -> None:
    """Until every model's timer has had the chance to make two more full checks (timer rounds
    counted, never seconds): time for a wrongly admitted rollout to start."""
    until = ticks() + models * (2 * FULL_CHECK_EVERY + 1)
    await _until(lambda: ticks() >= until, "more operator timer rounds")


def test_a_new_operator_version_rolls_at_most_n_models_at_a_time_and_a_user_edit_is_never_gated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three models rolled out by the previous operator version; the new one (a new runtime image
    default) under maxConcurrentRollouts 1: one rolls, the others say RolloutPending naming it;
    each finished rollout admits exactly one more; a user's edit of a waiting model rolls at
    once, past the limit; in the end every model is on the new image and none is pending."""
    names = ["model-0", "model-1", "model-2"]
    monkeypatch.setenv(IMAGE_ENV, OLD)

    async def scenario() -> None:
        async with api_server() as cluster:
            await _fleet_on_old_image(cluster, names, 1)
            monkeypatch.setenv(IMAGE_ENV, NEW)  # the chart's upgrade: a new default runtime image
            op = await _start(cluster, 1)
            edited: set[str] = set()
            most = 0

            def on_new() -> list[str]:
                return [n for n in names if _image_now(cluster, n) == NEW]

            async def watch() -> None:  # how many operator rollouts are in progress, all along
                nonlocal most
                while True:  # a rollout stays in progress until this test rolls it out: none is missed
                    deps = [_stored(cluster, "deployments", n) for n in names if n not in edited]
                    busy = [d for d in deps if d and d["spec"]["template"]["spec"]["containers"][0]["image"] == NEW
                            and not rollout_gate.rolled_out(d, d["metadata"]["generation"])]
                    most = max(most, len(busy))
                    await asyncio.sleep(0.05)

            watcher = asyncio.create_task(watch())
            try:
                await _until(lambda: len(on_new()) == 1, "one model rolling")
                (first,) = on_new()
                waiting = [n for n in names if n != first]
                for name in waiting:
                    await _until(lambda n=name: _pending_now(cluster, n, "WaitingForRolloutSlot"),
                                 f"{name} RolloutPending")
                    message = _cond(_stored(cluster, "inferencedeployments", name), "RolloutPending")["message"]
                    assert f"default/{first}" in message, message
                await _full_checks(len(names))
                assert on_new() == [first]  # nobody else started

                await _roll_out(cluster, first)  # it completes: exactly one more starts
                await _until(lambda: len(on_new()) == 2, "a second operator rollout")
                (second,) = [n for n in on_new() if n != first]
                (last,) = [n for n in waiting if n != second]
                await _until(lambda: _pending_now(cluster, second, None), f"{second} no longer pending")
                assert _cond(_stored(cluster, "inferencedeployments", second), "RolloutPending")["reason"] \
                    == "NoPendingRollout"
                await _full_checks(len(names))
                assert _image_now(cluster, last) == OLD
                await _until(lambda: f"default/{second}" in (_cond(_stored(cluster, "inferencedeployments", last),
                                                                   "RolloutPending") or {}).get("message", ""),
                             f"{last} RolloutPending naming {second}")

                edited.add(last)  # a user's edit of the waiting model rolls at once, past the limit
                await cluster.patch_cr(last, {"spec": {"podAnnotations": {"team": "search"}}})
                await _until(lambda: _image_now(cluster, last) == NEW, "the edited model rolled")

                await _roll_out(cluster, second)
                await _roll_out(cluster, last)
                for name in names:  # all rolled, none pending
                    await _until(lambda n=name: _pending_now(cluster, n, None), f"{name} no longer pending")
                assert sorted(on_new()) == names
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
                await op.shutdown()
            assert most == 1
            assert not uncovered_requests(cluster.api), uncovered_requests(cluster.api)
            ledger = await cluster.get("/api/v1/namespaces/inflight-system/configmaps/" + rollout_gate.LEDGER_NAME)
            assert all(json.loads(v)["generation"] >= 1 for v in (ledger.get("data") or {}).values())

    asyncio.run(asyncio.wait_for(scenario(), 6 * PATIENCE_S))  # under pytest-timeout's 600 s


async def _cleared_after_pending(cluster: Cluster, name: str) -> bool:
    cond = _cond(await cluster.cr(name), "RolloutPending")
    return bool(cond and cond["status"] == "False" and cond["reason"] == "NoPendingRollout")


def test_manual_mode_waits_for_the_approval_annotation_and_removes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["alpha", "beta"]
    monkeypatch.setenv(IMAGE_ENV, OLD)

    async def scenario() -> None:
        async with api_server() as cluster:
            await _fleet_on_old_image(cluster, names, "manual")
            monkeypatch.setenv(IMAGE_ENV, NEW)
            op = await _start(cluster, "manual")
            try:
                for name in names:
                    await _until(lambda n=name: _pending_now(cluster, n, "AwaitingApproval"), f"{name} waits")
                await _full_checks(len(names))
                assert await _on_new(cluster, names) == []
                await cluster.patch_cr("alpha", {"metadata": {"annotations": {
                    rollout_gate.APPROVAL_ANNOTATION: rollout_gate.APPROVED}}})
                await _wait(lambda: _image_is(cluster, "alpha", NEW), what="the approved model rolled")

                async def removed() -> bool:
                    cr = await cluster.cr("alpha")
                    return rollout_gate.APPROVAL_ANNOTATION not in (cr["metadata"].get("annotations") or {})

                await _wait(removed, what="the approval used once and removed")
                await _wait(lambda: _cleared_after_pending(cluster, "alpha"), what="alpha no longer pending")
                await _full_checks(len(names))
                assert await _on_new(cluster, names) == ["alpha"]
                assert await _pending(cluster, "beta", "AwaitingApproval")
            finally:
                await op.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 300))


def test_the_slots_live_in_the_cluster_so_a_restarted_operator_counts_them() -> None:
    """A fresh operator context (as after a restart) reads the rollouts in progress from the
    ledger and the Deployments' status: nothing about the slots is kept in memory."""

    async def scenario() -> None:
        async with api_server() as cluster:
            for name in ("a", "b", "c"):
                await cluster.create(DEPLOYS, {"apiVersion": "apps/v1", "kind": "Deployment",
                                               "metadata": {"name": name, "namespace": "default"},
                                               "spec": {"replicas": 1, "selector": {"matchLabels": {"x": name}},
                                                        "template": {"metadata": {"labels": {"x": name}}}}})
            ledger = {"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": rollout_gate.LEDGER_NAME, "namespace": OPERATOR_NAMESPACE},
                      "data": {"default.a": json.dumps({"generation": 1}), "default.b": json.dumps({"generation": 1}),
                               "default.gone": json.dumps({"generation": 3})}}
            await cluster.create(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/configmaps", ledger)
            ctx = OperatorContext(OperatorConfig(lease_namespace=OPERATOR_NAMESPACE, max_concurrent_rollouts=2))
            ctx.set_connection(kopf.ConnectionInfo(server=cluster.api_url, insecure=True))
            try:
                gate = await rollout_gate.admit(ctx.kube, OPERATOR_NAMESPACE, 2, "default", "c", False)
                assert gate.waiting and "default/a" in gate.message and "default/b" in gate.message
                assert not (await rollout_gate.admit(ctx.kube, OPERATOR_NAMESPACE, 2, "default", "c", True)).waiting
                await _roll_out(cluster, "a")
                assert not (await rollout_gate.admit(ctx.kube, OPERATOR_NAMESPACE, 2, "default", "c", False)).waiting
                left = await cluster.get(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/configmaps/{rollout_gate.LEDGER_NAME}")
                assert set(left["data"]) == {"default.b"}  # finished and deleted models dropped
                await rollout_gate.record(ctx.kube, OPERATOR_NAMESPACE, "default", "c", 1)
                gate = await rollout_gate.admit(ctx.kube, OPERATOR_NAMESPACE, 2, "default", "d", False)
                assert gate.waiting and "default/c" in gate.message
            finally:
                await ctx.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
