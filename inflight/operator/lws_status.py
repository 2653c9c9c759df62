"""What the operator reads back from a multi-node InferenceDeployment's LeaderWorkerSet.

Owns: which workload kind serves a spec (``workload_kind``: a Deployment, or the LWS when
``spec.nodes`` > 1), the refusal for an API server without the LWS kind (``missing_hint``,
reason ``LeaderWorkerSetMissing``: the LWS CRD is checked wherever the operator applies or
repairs the LWS, at start, at every spec change and at every tick that finds it gone), and the
``GroupsReady`` condition, read from the pods' LWS labels (``group-index``: a group is ready
when all ``nodes`` of its pods are). LWS's own status counts groups (``replicas``,
``readyReplicas``, ``updatedReplicas``), the names a Deployment uses, so the CR's replica counts
and Ready condition read it as they read a Deployment; the rollout gate reads from it when an
LWS finished rolling out (``rolled_out``: every group ready at the new generation). Pure, except ``group_pods``'s one pod
list (the workers' failures reach ``Degraded`` through it too). Knows nothing about kopf.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from inflight.operator import metrics_scrape, render
from inflight.operator.kube import DEPLOYMENTS, LEADER_WORKER_SETS, PODS, Kind
from inflight.operator.spec import InferenceSpec
from inflight.operator.status import Condition

if TYPE_CHECKING:  # the context imports the rollout gate, which imports this module
    from inflight.operator.context import OperatorContext

MISSING_REASON = "LeaderWorkerSetMissing"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # set by LWS on every pod of a group
LWS_DOCS = "https://lws.sigs.k8s.io/docs/installation/"


def workload_kind(spec: InferenceSpec) -> Kind:
    """The kind whose object (named like the resource) runs the pods."""
    return LEADER_WORKER_SETS if spec.nodes > 1 else DEPLOYMENTS


def pod_template(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod template of a live Deployment, or an LWS's leader template."""
    spec = workload.get("spec") or {}
    if "leaderWorkerTemplate" in spec:
        return (spec["leaderWorkerTemplate"] or {}).get("leaderTemplate") or {}
    return spec.get("template") or {}


def rolled_out(lws: dict[str, Any], since_generation: int) -> bool:
    """Whether the LWS ``lws`` finished rolling out its generation ``since_generation`` (or a later
    one): LWS's controller saw it (``status.observedGeneration``), every wanted group is updated
    to it and ready, and no group of the old revision is left (status counts groups)."""
    st = lws.get("status") or {}
    if int(st.get("observedGeneration") or 0) < since_generation:
        return False
    want = (lws.get("spec") or {}).get("replicas")
    want = 1 if want is None else int(want)
    updated = int(st.get("updatedReplicas") or 0)
    return updated >= want and int(st.get("replicas") or 0) <= updated and int(st.get("readyReplicas") or 0) >= want


def missing_hint(spec: InferenceSpec) -> str:
    return (f"spec.nodes is {spec.nodes} but the API server serves no LeaderWorkerSet kind "
            f"(leaderworkerset.x-k8s.io/v1): install LeaderWorkerSet ({LWS_DOCS}); the operator retries "
            "with backoff and creates the group once it is there, or set nodes: 1")


def groups_condition(spec: InferenceSpec, groups: int, pods: list[dict[str, Any]], seen_ready: frozenset[str]
                     ) -> tuple[Condition, frozenset[str]]:
    """``GroupsReady``: every one of ``groups`` groups has all ``spec.nodes`` pods ready; and the
    groups seen fully ready so far (pass it back next time). A group seen ready before that is
    short now is being recreated by LWS (a pod of it failed or was deleted:
    ``RecreateGroupOnPodRestart``): reason ``GroupRecreating``, naming the group; a group never
    seen ready is ``GroupsStarting``."""
    ready: Counter[str] = Counter()
    for pod in pods:
        meta = pod.get("metadata") or {}
        index = (meta.get("labels") or {}).get(GROUP_INDEX_LABEL)
        if index is not None and not meta.get("deletionTimestamp"):
            ready[index] += metrics_scrape.pod_is_ready(pod)
    wanted = [str(i) for i in range(groups)]
    full = {i for i in wanted if ready[i] >= spec.nodes}
    seen = frozenset((seen_ready & set(wanted)) | full)
    if groups == 0:
        return Condition("GroupsReady", False, "ScaledToZero", "no groups are wanted"), seen
    short = [i for i in wanted if i not in full]
    if not short:
        return Condition("GroupsReady", True, "AllGroupsReady", f"{groups} group(s) of {spec.nodes} pods ready"), seen
    what = "; ".join(f"group {i}: {ready[i]}/{spec.nodes} pods ready" for i in short)
    recreating = [i for i in short if i in seen_ready]
    if not recreating:
        return Condition("GroupsReady", False, "GroupsStarting", f"{what} (starting)"), seen
    return Condition(
        "GroupsReady", False, "GroupRecreating",
        f"{what}. LeaderWorkerSet recreates group {', '.join(recreating)} as a unit (a pod of it failed or was "
        "deleted: RecreateGroupOnPodRestart); its leader serves again once every rank has joined"), seen


async def group_pods(ctx: OperatorContext, spec: InferenceSpec) -> list[dict[str, Any]]:
    """Every pod of every group (leaders and workers): a worker's failure is the group's."""
    return await ctx.cache.list(PODS, spec.namespace, render.selector_labels(spec.name))
