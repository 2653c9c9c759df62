"""``spec.nodes``: the LeaderWorkerSet rendered for a multi-node InferenceDeployment, checked
against LWS's own CRD schema (``lws_fixture``), and single-node resources left as they were."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from inflight.operator import crd, lws_status, reconcile, render, render_lws
from inflight.operator.kube import DEPLOYMENTS, LEADER_WORKER_SETS
from inflight.operator.spec import InferenceSpec, SpecDefaults, parse_spec
from inflight.operator.status import Condition
from tests.operator import kmock_schema
from tests.operator.lws_fixture import lws_schema

OWNER = render.Owner(name="llama", uid="uid-1", admin_key_id="kid-1")


def _spec(**extra: Any) -> InferenceSpec:
    raw = {"model": {"pvc": {"claimName": "models", "path": "llama-70b"}, "servedModelName": "llama-70b"},
           "resources": {"gpus": 8, "cpu": "32", "memory": "512Gi"}, **extra}
    return parse_spec("llama", "default", raw, SpecDefaults())


def _lws(**extra: Any) -> dict[str, Any]:
    return render_lws.render_leader_worker_set(_spec(nodes=2, **extra), OWNER, 1)


def test_rendered_lws_is_valid_against_the_lws_crd_schema() -> None:
    for extra in ({}, {"rollout": {"strategy": "Recreate"}}, {"engine": {"maxModelLen": 8192}},
                  {"nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}):
        lws = _lws(**extra)
        assert kmock_schema.strict_errors(lws, lws_schema()) == [], extra


def test_the_schema_check_can_fail() -> None:
    lws = _lws()
    bad = copy.deepcopy(lws)
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnRestart"  # a typo
    bad["spec"]["leaderWorkerTemplate"]["sizes"] = 2  # unknown: the API server would prune it
    errors = kmock_schema.strict_errors(bad, lws_schema())
    assert any("restartPolicy" in e for e in errors) and any("sizes" in e for e in errors), errors


def test_group_shape_leader_and_worker_templates() -> None:
    lws = _lws()
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["kind"] == "LeaderWorkerSet"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    assert tmpl["size"] == 2 and tmpl["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["replicas"] == 1 and lws["spec"]["startupPolicy"] == "LeaderCreated"
    leader = tmpl["leaderTemplate"]["spec"]["containers"][0]
    worker = tmpl["workerTemplate"]["spec"]["containers"][0]
    assert tmpl["leaderTemplate"]["metadata"]["labels"][render.ROLE_LABEL] == "leader"
    assert tmpl["workerTemplate"]["metadata"]["labels"][render.ROLE_LABEL] == "worker"
    # TP inside a pod, one pipeline stage per pod, the rendezvous from LWS's env
    for args in (leader["args"], worker["args"]):
        joined = " ".join(args)
        assert "--tensor-parallel-size 8" in joined and "--pipeline-parallel-size 2" in joined
        assert "--nnodes 2 --node-rank $(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS)" in joined
    assert "--headless" in worker["args"] and "--headless" not in leader["args"]
    # probes and the http port on the leader only
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(leader)
    assert not {"startupProbe", "livenessProbe", "readinessProbe"} & set(worker)
    assert [p["name"] for p in leader["ports"]] == ["http"] and "ports" not in worker
    assert "prometheus.io/scrape" not in tmpl["workerTemplate"]["metadata"]["annotations"]
    # every pod of the group gets the node's GPUs and resources
    for c in (leader, worker):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and c["resources"]["requests"]["cpu"] == "32"


def test_rollout_maps_to_lws_rolling_update() -> None:
    assert _lws()["spec"]["rolloutStrategy"] == {
        "type": "RollingUpdate", "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}}
    assert _lws(rollout={"strategy": "Recreate"})["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {
        "maxSurge": 0, "maxUnavailable": "100%"}


def test_children_swap_the_deployment_for_the_lws_and_the_service_selects_leaders() -> None:
    multi = reconcile.rendered_children(_spec(nodes=2), OWNER)
    kinds = [(kind.kind, body["metadata"]["name"]) for kind, body, _ in multi]
    assert ("LeaderWorkerSet", "llama") in kinds and ("Deployment", "llama") not in kinds
    service = next(body for kind, body, _ in multi if body["kind"] == "Service")
    assert service["spec"]["selector"][render.ROLE_LABEL] == "leader"
    autoscaled = _spec(nodes=2, autoscaling={"enabled": True, "minReplicas": 1, "maxReplicas": 3})
    _, body, patch = next(c for c in reconcile.rendered_children(autoscaled, OWNER) if c[0] == LEADER_WORKER_SETS)
    assert body["spec"]["replicas"] == 1 and "replicas" not in patch["spec"]  # the autoscaler owns it
    assert patch["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["affinity"] is None
    assert lws_status.workload_kind(autoscaled) == LEADER_WORKER_SETS


def test_single_node_renders_exactly_what_it_did() -> None:
    """nodes: 1 (or unset) is today's Deployment: the same children, byte for byte."""
    plain, explicit = _spec(), _spec(nodes=1)
    assert plain.nodes == explicit.nodes == 1
    assert reconcile.rendered_children(plain, OWNER) == reconcile.rendered_children(explicit, OWNER)
    kinds = [kind for kind, _, _ in reconcile.rendered_children(plain, OWNER)]
    assert DEPLOYMENTS in kinds and LEADER_WORKER_SETS not in kinds
    deployment = render.render_deployment(plain, OWNER, 1)
    assert render.ROLE_LABEL not in deployment["spec"]["template"]["metadata"]["labels"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not {"--pipeline-parallel-size", "--nnodes", "--headless"} & set(args)
    assert render.render_service(plain, OWNER)["spec"]["selector"] == render.selector_labels("llama")
    assert lws_status.workload_kind(plain) == DEPLOYMENTS


@pytest.mark.parametrize(("extra", "words"), [
    ({"nodes": 0}, "spec.nodes"),
    ({"nodes": 2, "engine": {"pipelineParallelSize": 4}}, "must equal spec.nodes"),
    ({"nodes": 2, "autoscaling": {"enabled": True, "minReplicas": 0}}, "scale from zero"),
    ({"nodes": 2, "inferencePool": {"enabled": True}}, "spec.inferencePool"),
    ({"nodes": 2, "resources": {"gpus": 1}, "engine": {"enableLora": True}}, "LoRA"),
    ({"nodes": 2, "model": {"hf": {"repoId": "x/y"}, "servedModelName": "y", "cache": {"size": "10Gi"}}},
     "ReadWriteOnce"),
    ({"nodes": 2, "resources": {"gpus": 1}, "engine": {"asyncScheduling": True}}, "spec.nodes: 2"),
])
def test_multi_node_refusals_name_the_field(extra: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        _spec(**extra)


def test_pipeline_size_follows_nodes() -> None:
    assert _spec(nodes=3).engine["pipeline_parallel_size"] == 3
    assert _spec(nodes=2, engine={"pipelineParallelSize": 2}).engine["pipeline_parallel_size"] == 2
    assert "pipeline_parallel_size" not in _spec().engine


def test_crd_has_nodes_with_a_transition_rule() -> None:
    nodes = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["nodes"]
    assert nodes["minimum"] == 1 and nodes["default"] == 1
    assert "oldSelf" in nodes["x-kubernetes-validations"][0]["rule"]


def _pod(group: int, worker: int, ready: bool) -> dict[str, Any]:
    return {"metadata": {"name": f"p{group}-{worker}", "labels": {lws_status.GROUP_INDEX_LABEL: str(group)}},
            "status": {"phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_groups_condition_tells_starting_from_recreating() -> None:
    spec = _spec(nodes=2)
    cond, seen = lws_status.groups_condition(spec, 1, [_pod(0, 0, True)], frozenset())
    assert (cond.status, cond.reason) == (False, "GroupsStarting") and seen == frozenset()
    cond, seen = lws_status.groups_condition(spec, 1, [_pod(0, 0, True), _pod(0, 1, True)], seen)
    assert cond == Condition("GroupsReady", True, "AllGroupsReady", "1 group(s) of 2 pods ready")
    cond, seen = lws_status.groups_condition(spec, 2, [_pod(0, 0, True)], seen)  # a worker died; group 1 new
    assert (cond.status, cond.reason) == (False, "GroupRecreating")
    assert "group 0: 1/2 pods ready" in cond.message and "recreates group 0 " in cond.message
    cond, seen = lws_status.groups_condition(spec, 1, [], seen)  # the group's pods all gone meanwhile
    assert cond.reason == "GroupRecreating" and seen == frozenset({"0"})


def test_admin_key_id_is_read_from_the_leader_template() -> None:
    """The admin Secret is replaced when the pods' key id differs from the root key's: for an LWS
    the record is on the leader template (and on the worker's, so the whole group rolls)."""
    lws = _lws()
    template = lws_status.pod_template(lws)
    assert template["metadata"]["annotations"][render.ADMIN_KEY_ID_ANNOTATION] == "kid-1"
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert worker["metadata"]["annotations"][render.ADMIN_KEY_ID_ANNOTATION] == "kid-1"
    deployment = render.render_deployment(_spec(), OWNER, 1)
    assert lws_status.pod_template(deployment) is deployment["spec"]["template"]


def test_the_runtime_parses_what_each_pod_of_the_group_runs() -> None:
    """The leader's and a worker's args, with LWS's variables expanded as Kubernetes does, are
    flags the runtime knows, and give the engine the group's sizes and rendezvous."""
    from inflight.runtime.cli.command import build_parser, engine_config_from_args

    lws = _lws()
    env = {"LWS_WORKER_INDEX": None, "LWS_LEADER_ADDRESS": "llama-0.llama.default", "INFLIGHT_LIVE_MAX_NUM_SEQUENCES": "64",
           "INFLIGHT_LIVE_MAX_NUM_TOKENS": "8192", "INFLIGHT_LIVE_MAX_QUEUE_LEN": "1000"}
    for index, role in ((0, "leaderTemplate"), (1, "workerTemplate")):
        args = lws["spec"]["leaderWorkerTemplate"][role]["spec"]["containers"][0]["args"]
        env["LWS_WORKER_INDEX"] = str(index)
        expanded = [next((v for k, v in env.items() if a == f"$({k})"), a) for a in args]
        assert not [a for a in expanded if a.startswith("$(")], expanded
        parsed = build_parser().parse_args(expanded)
        config = engine_config_from_args(parsed)
        assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (8, 2)
        assert (config.nnodes, config.node_rank, config.master_addr, config.master_port) == (
            2, index, "llama-0.llama.default", render_lws.RENDEZVOUS_PORT)
        assert parsed.headless == (index == 1)
