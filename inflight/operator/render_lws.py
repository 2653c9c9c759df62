"""Pure builder of the LeaderWorkerSet (``leaderworkerset.x-k8s.io/v1``) that serves a
multi-node InferenceDeployment (``spec.nodes`` > 1) in place of the Deployment.

Owns what the LWS looks like: ``size`` = nodes pods per group, ``replicas`` = groups (the
autoscaler's unit), ``RecreateGroupOnPodRestart`` (a rank that dies takes its group down and
LWS starts the whole group again: a pipeline cannot lose a stage), ``startupPolicy:
LeaderCreated`` (the workers start beside the leader: the leader only becomes ready once they
joined it), and the two pod templates. The leader's is the single-node pod template
(``render.render_pod_template``: front end, engine core rank 0, probes, the http port) with
the group's flags and the role label ``inflight.dev/role: leader``, which the Service and the
operator's pod list select; the workers' runs the same image and engine flags with
``--headless`` (ranks 1..N-1, no front end), no probes and no http port. The rendezvous flags
read the variables LWS sets in every container (``$(LWS_LEADER_ADDRESS)``,
``$(LWS_WORKER_INDEX)``: 0 on the leader), expanded by Kubernetes at container start.
No I/O, no clock.
"""

from __future__ import annotations

import copy
from typing import Any

from inflight.operator import render
from inflight.operator.spec import InferenceSpec

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
RESTART_POLICY = "RecreateGroupOnPodRestart"
STARTUP_POLICY = "LeaderCreated"
RENDEZVOUS_PORT = 29500  # torch.distributed's customary MASTER_PORT, on the leader
# The runtime's flags (vLLM's spellings) the group's pods are started with.
NNODES_FLAG = "--nnodes"
NODE_RANK_FLAG = "--node-rank"
MASTER_ADDR_FLAG = "--master-addr"
MASTER_PORT_FLAG = "--master-port"
HEADLESS_FLAG = "--headless"
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def group_flags(spec: InferenceSpec) -> list[str]:
    """Flags every pod of the group gets besides the engine's (``--pipeline-parallel-size`` is one
    of those, ``spec.engine``): how many pods, which one this is and where rank 0 listens."""
    return [
        NNODES_FLAG, str(spec.nodes),
        NODE_RANK_FLAG, "$(LWS_WORKER_INDEX)",
        MASTER_ADDR_FLAG, "$(LWS_LEADER_ADDRESS)",
        MASTER_PORT_FLAG, str(RENDEZVOUS_PORT),
    ]


def _with_role(template: dict[str, Any], role: str) -> dict[str, Any]:
    template["metadata"]["labels"][render.ROLE_LABEL] = role
    return template


def leader_template(spec: InferenceSpec, admin_key_id: str = "") -> dict[str, Any]:
    template = _with_role(render.render_pod_template(spec, admin_key_id), "leader")
    container = template["spec"]["containers"][0]
    container["args"] = [*container["args"], *group_flags(spec)]
    return template


def worker_template(spec: InferenceSpec, admin_key_id: str = "") -> dict[str, Any]:
    """The leader's template as a headless rank: no probes, no http port, no scrape annotations."""
    template = _with_role(render.render_pod_template(spec, admin_key_id), "worker")
    container = template["spec"]["containers"][0]
    container["args"] = [*container["args"], *group_flags(spec), HEADLESS_FLAG]
    for probe in PROBES:
        container.pop(probe, None)
    container["ports"] = [p for p in container["ports"] if p.get("name") != "http"]
    if not container["ports"]:
        del container["ports"]
    template["spec"].pop("readinessGates", None)
    annotations = template["metadata"]["annotations"]
    for key in render.PROMETHEUS_ANNOTATIONS:
        annotations.pop(key, None)
    return template


def _rollout(spec: InferenceSpec) -> dict[str, Any]:
    """LWS rolls groups: ``Recreate`` is every group unavailable at once, no surge."""
    if spec.rollout.type == "Recreate":
        update: dict[str, Any] = {"maxSurge": 0, "maxUnavailable": "100%"}
    else:
        update = {"maxSurge": spec.rollout.max_surge, "maxUnavailable": spec.rollout.max_unavailable}
    return {"type": "RollingUpdate", "rollingUpdateConfiguration": update}


def render_leader_worker_set(spec: InferenceSpec, owner: render.Owner, replicas: int | None) -> dict[str, Any]:
    """The LWS; ``replicas=None`` leaves the group count out (the autoscaler owns it)."""
    deployment = render.render_deployment(spec, owner, None)  # the metadata (owner, labels) is the same
    lws_spec: dict[str, Any] = {
        "startupPolicy": STARTUP_POLICY,
        "rolloutStrategy": _rollout(spec),
        "leaderWorkerTemplate": {
            "size": spec.nodes,
            "restartPolicy": RESTART_POLICY,
            "leaderTemplate": leader_template(spec, owner.admin_key_id),
            "workerTemplate": worker_template(spec, owner.admin_key_id),
        },
    }
    if replicas is not None:
        lws_spec["replicas"] = replicas
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": deployment["metadata"], "spec": lws_spec}


def lws_patch(lws: dict[str, Any], autoscaling: bool) -> dict[str, Any]:
    """The merge patch that brings an existing LWS to ``lws``: optional pod-spec keys the spec no
    longer sets become ``null``, and with autoscaling on ``replicas`` is left to the autoscaler."""
    patch = copy.deepcopy(lws)
    if autoscaling:
        patch["spec"].pop("replicas", None)
    template = patch["spec"]["leaderWorkerTemplate"]
    for key in ("leaderTemplate", "workerTemplate"):
        pod_spec = template[key]["spec"]
        for optional in render.OPTIONAL_POD_KEYS:
            pod_spec.setdefault(optional, None)
    return patch
