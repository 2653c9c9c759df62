"""Pure builders of the partner autoscaler objects: an ``autoscaling/v2`` HorizontalPodAutoscaler or a
``keda.sh/v1alpha1`` ScaledObject on the model's workload, driven by the operator's exported signals.

Each signal with a target becomes one metric: the HPA reads the operator's gauges as external
metrics (``partners.METRIC_NAMES``, selected by the model's labels) with ``target.type: Value``;
KEDA's prometheus scaler queries the same series with ``metricType: Value``. Both then compute
``ceil(replicas x signal / target)`` per metric and take the largest, the operator's own formula.
Kubernetes I/O only through the client ``delete_stale`` is handed (``reconcile`` applies what
``rendered`` returns; switching the partner off deletes what this resource owns of ``partner_children``).
"""

from __future__ import annotations

from typing import Any

from inflight.operator import partners, render
from inflight.operator.kube import HPAS, SCALED_OBJECTS, Kind, KubeClient
from inflight.operator.spec import InferenceSpec

HPA_MAX_WINDOW_S = 3600  # autoscaling/v2 behavior: stabilizationWindowSeconds <= 3600


def targets(spec: InferenceSpec) -> list[tuple[str, float]]:
    """(signal, target) for each signal the spec sets a target for (TTFT only with one)."""
    a = spec.autoscaling
    out = [("queueDepth", a.target_queue_depth), ("kvCacheUsage", a.target_kv_cache_usage)]
    if a.target_ttft_seconds is not None:
        out.append(("ttftBacklogSeconds", a.target_ttft_seconds))
    return out


def _quantity(value: float) -> str:
    """A Kubernetes quantity for ``value`` in milli-units (0.8 -> "800m")."""
    return f"{round(value * 1000)}m"


def _selector(spec: InferenceSpec) -> dict[str, str]:
    return {partners.NAMESPACE_LABEL: spec.namespace, partners.NAME_LABEL: spec.name}


def _target_ref(spec: InferenceSpec) -> dict[str, str]:
    if spec.nodes > 1:  # a LeaderWorkerSet (its scale subresource counts groups)
        return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet", "name": spec.name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": spec.name}


def _metadata(spec: InferenceSpec, owner: render.Owner, name: str) -> dict[str, Any]:
    return {
        "name": name, "namespace": spec.namespace, "labels": render.common_labels(spec.name),
        "ownerReferences": [{"apiVersion": f"{render.API_GROUP}/{render.API_VERSION}", "kind": render.KIND,
                             "name": owner.name, "uid": owner.uid, "controller": True,
                             "blockOwnerDeletion": True}],
    }


def _behavior(spec: InferenceSpec) -> dict[str, Any]:
    a = spec.autoscaling
    return {
        "scaleUp": {"stabilizationWindowSeconds": min(HPA_MAX_WINDOW_S, int(a.scale_up_stabilization_seconds))},
        "scaleDown": {"stabilizationWindowSeconds": min(HPA_MAX_WINDOW_S, int(a.scale_down_stabilization_seconds))},
    }


def render_hpa(spec: InferenceSpec, owner: render.Owner) -> dict[str, Any]:
    """The HPA on the workload, one External metric per signal (served by a metrics adapter)."""
    metrics = [{"type": "External", "external": {
        "metric": {"name": partners.METRIC_NAMES[signal], "selector": {"matchLabels": _selector(spec)}},
        "target": {"type": "Value", "value": _quantity(target)}}} for signal, target in targets(spec)]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(spec, owner, spec.name),
        "spec": {"scaleTargetRef": _target_ref(spec), "minReplicas": spec.autoscaling.min_replicas,
                 "maxReplicas": spec.autoscaling.max_replicas, "metrics": metrics, "behavior": _behavior(spec)},
    }


def prometheus_query(spec: InferenceSpec, signal: str) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in _selector(spec).items())
    return f"max({partners.METRIC_NAMES[signal]}{{{labels}}})"  # max: one series per operator replica


def render_scaled_object(spec: InferenceSpec, owner: render.Owner) -> dict[str, Any]:
    """KEDA's ScaledObject on the workload: one prometheus trigger per signal (``metricType: Value``)."""
    partner = spec.autoscaling.partner
    assert partner is not None and partner.kind == "keda"
    a = spec.autoscaling
    triggers = [{"type": "prometheus", "name": signal, "metricType": "Value", "metadata": {
        "serverAddress": partner.prometheus_address, "query": prometheus_query(spec, signal),
        "threshold": f"{target:g}", "ignoreNullValues": "true"}} for signal, target in targets(spec)]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": _metadata(spec, owner, spec.name),
        "spec": {
            "scaleTargetRef": _target_ref(spec),
            "pollingInterval": max(1, int(a.interval_seconds)),
            "cooldownPeriod": int(a.scale_down_stabilization_seconds),  # only 1 -> 0 uses it
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {
                "name": partners.hpa_name(spec.name, partner), "behavior": _behavior(spec)}},
            "triggers": triggers,
        },
    }


def rendered(spec: InferenceSpec, owner: render.Owner) -> list[tuple[Kind, dict[str, Any], dict[str, Any]]]:
    """(kind, object, merge patch) of the partner object the spec asks for (none without a partner)."""
    partner = spec.autoscaling.partner
    if not spec.autoscaling.enabled or partner is None:
        return []
    obj = render_hpa(spec, owner) if partner.kind == "hpa" else render_scaled_object(spec, owner)
    return [(HPAS if partner.kind == "hpa" else SCALED_OBJECTS, obj, obj)]


def partner_children(name: str) -> list[tuple[Kind, str]]:
    """What a partner mode may create (deleted when the partner is switched off or changed)."""
    return [(HPAS, name), (SCALED_OBJECTS, name)]


def stale(spec: InferenceSpec, live: dict[Kind, dict[str, Any] | None], uid: str) -> list[Kind]:
    """The partner objects in ``live`` (as read, by kind) that this resource owns (``uid``) and the
    spec no longer asks for: delete them. An HPA of the same name that it does not own is left alone."""
    wanted = {kind for kind, _, _ in rendered(spec, render.Owner(spec.name, uid))}
    out = []
    for kind, obj in live.items():
        owners = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
        if obj is not None and kind not in wanted and uid and any(o.get("uid") == uid for o in owners):
            out.append(kind)
    return out


async def delete_stale(kube: KubeClient, spec: InferenceSpec, uid: str) -> list[str]:
    """Delete the partner objects this resource owns that the spec no longer asks for; "Kind/name" of each.
    A cluster without KEDA answers 404 for ScaledObjects: nothing to delete."""
    live = {kind: await kube.get(kind, spec.namespace, name) for kind, name in partner_children(spec.name)}
    deleted = []
    for kind in stale(spec, live, uid):
        if await kube.delete(kind, spec.namespace, spec.name):
            deleted.append(f"{kind.kind}/{spec.name}")
    return deleted
