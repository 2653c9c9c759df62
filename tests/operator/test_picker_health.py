"""The endpoint picker in the CR's conditions (``PickerReady``; ``Ready=False`` while a FailClose
pool has no picker), its HA (replicas with leader election) and the RBAC rendered for it."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kubernetes_validate
import pytest

from inflight.operator import picker_health, render, render_pool
from inflight.operator.render import Owner
from inflight.operator.spec import SpecDefaults, parse_spec
from tests.operator.helpers import EXAMPLES, MINIMAL_SPEC, load_example, make_spec
from tests.operator.kmock_harness import running_operator, wait_for
from tests.operator.test_spec_and_crd import K8S_VERSION

OWNER = Owner(name="demo", uid="u1")
DEPLOYS = "/apis/apps/v1/namespaces/default/deployments"


def _pool(**picker: Any) -> dict[str, Any]:
    return {"inferencePool": {"enabled": True, "endpointPicker": picker}}


def _picker(want: int, ready: int) -> dict[str, Any]:
    return {"spec": {"replicas": want}, "status": {"readyReplicas": ready}}


def test_picker_ready_follows_the_picker_deployment_and_fail_close_takes_ready_away() -> None:
    close, open_ = make_spec(_pool()), make_spec(_pool(failureMode="FailOpen"))
    missing = picker_health.condition(close, None)
    assert (missing.status, missing.reason) == (False, "PickerMissing")
    down = picker_health.condition(close, _picker(1, 0))
    assert (down.status, down.reason) == (False, "PickerUnavailable") and "fails every request" in down.message
    ready = picker_health.ready_override(close, down)
    assert ready is not None and (ready.type, ready.status, ready.reason) == ("Ready", False, "PickerUnavailable")
    assert picker_health.ready_override(open_, picker_health.condition(open_, _picker(1, 0))) is None  # routes anyway
    leader = picker_health.condition(close, _picker(3, 1))  # standbys are NotReady by design
    assert leader.status and "2 standing by" in leader.message
    assert picker_health.ready_override(close, leader) is None
    assert not picker_health.watched(make_spec(_pool(create=False, serviceName="gw-epp")))  # the user's picker


def test_picker_replicas_run_its_leader_election() -> None:
    (_, one, _) = render.render_pool_objects(make_spec(_pool()), OWNER)
    (_, three, _) = render.render_pool_objects(make_spec(_pool(replicas=3)), OWNER)
    c1, c3 = one["spec"]["template"]["spec"]["containers"][0], three["spec"]["template"]["spec"]["containers"][0]
    assert "--ha-enable-leader-election" not in c1["args"] and one["spec"]["replicas"] == 1
    assert "--ha-enable-leader-election" in c3["args"] and three["spec"]["replicas"] == 3
    # Only the leader is Ready: the probes ask the picker's own liveness/readiness services.
    assert (c3["livenessProbe"]["grpc"]["service"], c3["readinessProbe"]["grpc"]["service"]) == ("liveness", "readiness")
    # A new pod turns Ready only once it leads: no surge waiting on it.
    assert three["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    for obj in (one, three):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    with pytest.raises(ValueError, match="replicas must be <= 5"):
        make_spec(_pool(replicas=6))
    with pytest.raises(ValueError, match="create: false"):
        make_spec(_pool(create=False, serviceName="gw-epp", replicas=2))


def test_picker_rbac_binds_the_charts_cluster_role_to_its_own_service_account() -> None:
    raw = {**copy.deepcopy(MINIMAL_SPEC), **_pool()}
    spec = parse_spec("demo", "ns1", raw, SpecDefaults(picker_cluster_role="inflight-epp"))
    _, deploy, _, account, binding = render.render_pool_objects(spec, OWNER)
    assert account["kind"] == "ServiceAccount" and account["metadata"]["name"] == "demo-epp"
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "demo-epp"
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "inflight-epp"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-epp", "namespace": "ns1"}]
    for obj in (account, binding):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    # A ServiceAccount of the user's, or no ClusterRole named by the installation: nothing rendered.
    own = parse_spec("demo", "ns1", {**raw, **_pool(serviceAccountName="mine")}, SpecDefaults(picker_cluster_role="x"))
    assert [o["kind"] for o in render.render_pool_objects(own, OWNER)] == ["InferencePool", "Deployment", "Service"]
    assert render_pool.picker_service_account(make_spec(_pool())) is None


def test_a_fail_close_pool_without_a_ready_picker_is_not_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_OPERATOR_PICKER_CLUSTER_ROLE", "inflight-epp")

    async def scenario() -> None:
        async with running_operator() as cluster:
            doc = copy.deepcopy(load_example(next(p for p in EXAMPLES if p.stem == "inference-pool")))
            name = doc["metadata"]["name"]
            doc["spec"]["inferencePool"]["endpointPicker"]["failureMode"] = "FailClose"
            doc["spec"]["inferencePool"]["endpointPicker"].pop("serviceAccountName", None)
            await cluster.create_cr(doc)
            await wait_for(lambda: cluster.child("deployments", f"{name}-epp"), timeout=60, what="the picker")
            binding = await wait_for(lambda: cluster.get(
                f"/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings/{name}-epp"), timeout=60,
                what="the picker's RoleBinding")
            assert binding["roleRef"]["name"] == "inflight-epp"
            assert await cluster.child("serviceaccounts", f"{name}-epp") is not None
            want = (await cluster.child("deployments", name))["spec"]["replicas"]
            await cluster.request("PATCH", f"{DEPLOYS}/{name}/status", {"status": {
                "replicas": want, "readyReplicas": want, "updatedReplicas": want}}, merge=True)

            async def conditions(picker: bool, ready: str) -> dict[str, Any] | None:
                conds = {c["type"]: c for c in ((await cluster.cr(name)) or {}).get("status", {}).get("conditions", [])}
                ok = (conds.get("PickerReady", {}).get("status") == ("True" if picker else "False")
                      and conds.get("Ready", {}).get("reason") == ready)
                return conds if ok else None

            async def pods_up_picker_down() -> dict[str, Any] | None:
                # Ready may say PickerUnavailable before the round that reads the patched pod status.
                conds = await conditions(False, "PickerUnavailable")
                return conds if conds and conds.get("Available", {}).get("status") == "True" else None

            conds = await wait_for(pods_up_picker_down, timeout=60, what="pods up, the picker not")
            assert conds["Ready"]["status"] == "False" and "fails every request" in conds["Ready"]["message"]
            await cluster.request("PATCH", f"{DEPLOYS}/{name}-epp/status", {"status": {"readyReplicas": 1}},
                                  merge=True)
            conds = await wait_for(lambda: conditions(True, "AllReplicasReady"), timeout=60, what="Ready again")
            assert conds["Ready"]["status"] == "True"

    asyncio.run(asyncio.wait_for(scenario(), 180))
