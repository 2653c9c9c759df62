"""Every refusal of the API server becomes a Degraded condition and one Warning Event, whatever
its status code, and never freezes status or drift repair of the running service.

One emulator test per refusal kind: a policy webhook's 403, a quota's 403 (on the first create),
409, 422, 500 and 503, and a request that never gets an answer. The emulator answers the chosen
request (``Fault``); everything else is the real operator against kmock.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from inflight.operator import refusals, render
from inflight.operator.kube import KubeError
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import (
    Cluster,
    Fault,
    api_server,
    running_operator,
    start_operator,
    uncovered_requests,
    wait_for,
)

NAME = "llama-minimal"
DEPLOY = f"/apis/apps/v1/namespaces/default/deployments/{NAME}"
EVENTS = "/api/v1/namespaces/default/events"
# Fast retries. The API timeout is long enough that a loaded machine's slow answer is never
# taken for a timeout (which would turn a refusal's ApplyRefused into ApplyFailed mid-test);
# the test of a request that never gets an answer sets its own short one (HANG_TIMEOUT_S).
FAST = {"retry_base_seconds": 0.2, "retry_max_seconds": 0.5, "api_timeout_seconds": 10.0}
HANG_TIMEOUT_S = 1.0
WEBHOOK = ('admission webhook "validate.kyverno.svc-fail" denied the request: policy Deployment/default/'
           f'{NAME} for resource violation: disallow-annotations: the team annotation "refused" is not allowed')
QUOTA = ('persistentvolumeclaims "qwen-hf-model-cache" is forbidden: exceeded quota: storage, requested: '
         'requests.storage=20Gi, used: requests.storage=90Gi, limited: requests.storage=100Gi')
CONFLICT = (f'Operation cannot be fulfilled on deployments.apps "{NAME}": the object has been modified; '
            'please apply your changes to the latest version and try again')
INVALID = (f'Deployment.apps "{NAME}" is invalid: metadata.annotations: Invalid value: "refused": '
           'rejected by a validating admission policy')


def _minimal() -> dict[str, Any]:
    return copy.deepcopy(load_example(next(p for p in EXAMPLES if p.stem == "minimal")))


def _cond(cr: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    return next((c for c in ((cr or {}).get("status") or {}).get("conditions") or [] if c["type"] == ctype), None)


async def _degraded(cluster: Cluster, reason: str, name: str = NAME) -> dict[str, Any] | None:
    cond = _cond(await cluster.cr(name), "Degraded")
    return cond if cond and cond["status"] == "True" and cond["reason"] == reason else None


async def _events(cluster: Cluster, reason: str) -> list[dict[str, Any]]:
    return [e for e in (await cluster.get(EVENTS))["items"] if e["reason"] == reason]


async def _applied(cluster: Cluster, generation: int, name: str = NAME) -> dict[str, Any] | None:
    cr = await cluster.cr(name)
    cond = _cond(cr, "Degraded")
    ok = cr and (cr.get("status") or {}).get("observedGeneration") == generation and cond and cond["status"] == "False"
    return cr if ok else None


async def _refused_edit(fault: Fault, reason: str, words: list[str], permanent: bool,
                        api_timeout_s: float = FAST["api_timeout_seconds"]) -> None:
    async with running_operator(**{**FAST, "api_timeout_seconds": api_timeout_s}) as cluster:
        await cluster.create_cr(_minimal())
        await wait_for(lambda: _applied(cluster, 1), what="generation 1 applied")
        cluster.api.faults.append(fault)
        await cluster.patch_cr(NAME, {"spec": {"podAnnotations": {"team": "refused"}}})
        cond = await wait_for(lambda: _degraded(cluster, reason), what=f"Degraded {reason}")
        for word in words:
            assert word in cond["message"], (word, cond["message"])
        cr = await cluster.cr(NAME)
        assert cr["metadata"]["generation"] == 2 and cr["status"]["observedGeneration"] == 1  # what applied

        await _still_serving(cluster, 1)  # the running service is not frozen
        assert (await _degraded(cluster, reason)) is not None  # the timer keeps the refusal in place

        if permanent:
            assert fault.hits == 1  # 400/422: not retried until the spec changes
        else:
            await wait_for(lambda: _true(fault.hits >= 3), what="retries")
        # This refusal's events only: under load an earlier read may have timed out (also ApplyFailed).
        events = [e for e in await _events(cluster, reason) if words[0] in e["message"]]
        assert [e["type"] for e in events] == ["Warning"], events  # once, not once per retry
        assert events[0]["involvedObject"]["name"] == NAME

        cluster.api.faults.remove(fault)  # the policy is lifted, the conflict over, the server back
        generation = 2
        if permanent:
            await cluster.patch_cr(NAME, {"spec": {"podAnnotations": {"team": "accepted"}}})
            generation = 3
        await wait_for(lambda: _applied(cluster, generation), what=f"generation {generation} applied")


async def _true(value: bool) -> bool:
    return value


def _run(coro: Any) -> None:
    asyncio.run(asyncio.wait_for(coro, 90))


def test_a_policy_webhook_403_is_degraded_with_its_message_and_retried() -> None:
    fault = Fault("PATCH", DEPLOY, 403, "Forbidden", WEBHOOK, body_part="refused")
    _run(_refused_edit(fault, "ApplyRefused", ["HTTP 403 Forbidden", "disallow-annotations",
                                               f"deployments/default/{NAME}", "generation 2"], permanent=False))


def test_a_409_conflict_is_degraded_and_retried() -> None:
    fault = Fault("PATCH", DEPLOY, 409, "Conflict", CONFLICT, body_part="refused")
    _run(_refused_edit(fault, "ApplyRefused", ["HTTP 409 Conflict", "object has been modified"], permanent=False))


def test_a_422_is_degraded_with_an_event_and_waits_for_the_next_spec() -> None:
    fault = Fault("PATCH", DEPLOY, 422, "Invalid", INVALID, body_part="refused")
    _run(_refused_edit(fault, "ApplyRefused", ["HTTP 422 Invalid", "validating admission policy",
                                               "not retried until the spec changes"], permanent=True))


@pytest.mark.parametrize(("code", "reason"), [(500, "InternalError"), (503, "ServiceUnavailable")])
def test_a_5xx_is_degraded_as_apply_failed_and_retried(code: int, reason: str) -> None:
    fault = Fault("PATCH", DEPLOY, code, reason, "etcdserver: request timed out", body_part="refused")
    _run(_refused_edit(fault, "ApplyFailed", [f"HTTP {code} {reason}", "etcdserver"], permanent=False))


def test_a_request_that_never_gets_an_answer_is_degraded_as_apply_failed() -> None:
    fault = Fault("PATCH", DEPLOY, hang=True, body_part="refused")
    _run(_refused_edit(fault, "ApplyFailed", ["Timeout", f"no answer within {HANG_TIMEOUT_S:g} s"], permanent=False,
                       api_timeout_s=HANG_TIMEOUT_S))


def test_a_quota_refusal_on_first_create_is_degraded_until_the_quota_allows_it() -> None:
    async def scenario() -> None:
        async with running_operator(**FAST) as cluster:
            fault = Fault("POST", "/persistentvolumeclaims", 403, "Forbidden", QUOTA)
            cluster.api.faults.append(fault)
            doc = copy.deepcopy(load_example(next(p for p in EXAMPLES if p.stem == "hf-cached")))
            doc["spec"]["replicas"] = 1
            name = doc["metadata"]["name"]
            await cluster.create_cr(doc)
            cond = await wait_for(lambda: _degraded(cluster, "ApplyRefused", name), what="Degraded ApplyRefused")
            assert "HTTP 403 Forbidden" in cond["message"] and "exceeded quota: storage" in cond["message"]
            assert "observedGeneration" not in (await cluster.cr(name))["status"]  # nothing applied yet
            await wait_for(lambda: _true(fault.hits >= 3), what="retries")
            assert len(await _events(cluster, "ApplyRefused")) == 1
            cluster.api.faults.remove(fault)
            await wait_for(lambda: _applied(cluster, 1, name), what="applied once the quota allows it")
            assert await cluster.child("persistentvolumeclaims", f"{name}-model-cache") is not None

    _run(scenario())


async def _still_serving(cluster: Cluster, replicas: int) -> None:
    """Status follows the Deployment and a deleted child comes back: the service is not frozen."""
    await cluster.request("PATCH", f"{DEPLOY}/status", {"status": {
        "replicas": replicas, "readyReplicas": replicas, "updatedReplicas": replicas}}, merge=True)

    async def ready() -> bool:
        return ((await cluster.cr(NAME)) or {}).get("status", {}).get("readyReplicas") == replicas

    await wait_for(ready, what=f"status follows the Deployment ({replicas} ready)")
    configmap = render.configmap_name(NAME)
    await cluster.request("DELETE", f"/api/v1/namespaces/default/configmaps/{configmap}")
    await wait_for(lambda: cluster.child("configmaps", configmap), what="drift repaired")


def test_a_restarted_operator_keeps_the_running_spec_while_the_edit_is_refused() -> None:
    async def scenario() -> None:
        async with api_server() as cluster:
            first = start_operator(cluster, **FAST)
            await asyncio.wait_for(first.ready.wait(), 10)
            await cluster.create_cr(_minimal())
            await wait_for(lambda: _applied(cluster, 1), what="generation 1 applied")
            fault = Fault("PATCH", DEPLOY, 403, "Forbidden", WEBHOOK, body_part="refused")
            cluster.api.faults.append(fault)
            await cluster.patch_cr(NAME, {"spec": {"podAnnotations": {"team": "refused"}}})
            await wait_for(lambda: _degraded(cluster, "ApplyRefused"), what="Degraded ApplyRefused")
            await first.shutdown()

            second = start_operator(cluster, **FAST)  # knows nothing of generation 1 but what the CR says
            try:
                await asyncio.wait_for(second.ready.wait(), 10)
                await wait_for(lambda: _true(fault.hits >= 3), what="the new operator retries too")
                await _still_serving(cluster, 2)
                assert await _degraded(cluster, "ApplyRefused") is not None
                cluster.api.faults.remove(fault)
                await wait_for(lambda: _applied(cluster, 2), what="generation 2 applied")
                assert not uncovered_requests(cluster.api)
            finally:
                await second.shutdown()

    _run(scenario())


def test_a_refused_repair_is_degraded_and_retried() -> None:
    async def scenario() -> None:
        async with running_operator(**FAST) as cluster:
            await cluster.create_cr(_minimal())
            await wait_for(lambda: _applied(cluster, 1), what="generation 1 applied")
            quota = ('deployments.apps "llama-minimal" is forbidden: exceeded quota: objects, requested: '
                     'count/deployments.apps=1, used: count/deployments.apps=10, limited: count/deployments.apps=10')
            fault = Fault("POST", "/apis/apps/v1/namespaces/default/deployments", 403, "Forbidden", quota)
            cluster.api.faults.append(fault)
            await cluster.request("DELETE", DEPLOY)
            cond = await wait_for(lambda: _degraded(cluster, "ApplyRefused"), what="Degraded ApplyRefused")
            assert "while repairing the children of generation 1" in cond["message"]
            assert "exceeded quota: objects" in cond["message"]
            await wait_for(lambda: _true(fault.hits >= 3), what="retries")
            assert len(await _events(cluster, "ApplyRefused")) == 1
            cluster.api.faults.remove(fault)
            await wait_for(lambda: _applied(cluster, 1), what="repaired, Degraded cleared")
            assert await cluster.child("deployments", NAME) is not None

    _run(scenario())


def test_refusal_values_and_backoff() -> None:
    webhook = KubeError(403, "patch", "deployments/ns/x", WEBHOOK, "Forbidden")
    refusal = refusals.from_error(webhook, 4)
    assert (refusal.reason, refusal.code, refusal.permanent) == ("ApplyRefused", 403, False)
    assert refusal.condition().status and refusal.condition().reason == "ApplyRefused"
    assert refusals.from_error(KubeError(422, "patch", "x", "bad", "Invalid"), 4).permanent
    timeout = refusals.from_error(KubeError(0, "patch", "x", "no answer within 30 s", "Timeout"), 4)
    assert timeout.reason == "ApplyFailed" and timeout.text().startswith("Timeout on patch x")
    assert refusal.key == refusals.from_error(webhook, 4).key != refusals.from_error(webhook, 5).key
    assert [refusals.retry_delay(n, 5, 300) for n in range(8)] == [5, 10, 20, 40, 80, 160, 300, 300]
    assert refusals.retry_delay(10_000, 5, 300) == 300
