"""Pure builders of the InferenceDeployment ``status``: conditions and the status patches.

Owns the status vocabulary: conditions Ready (all replicas), Available (at least one),
Progressing, Degraded (a spec error or a refusal from the API server: InvalidSpec, ApplyRefused,
ApplyFailed, see ``refusals``; or the pods' own failure: Unschedulable, ImagePullBackOff,
CrashLoopBackOff, FailedCreate), MetricsUnavailable, AutoscalingConflict, ForeignAutoscaler (each with reason,
message, lastTransitionTime, observedGeneration; a condition's transition time changes
only when its status does), replica counts, observed KV usage and queue depth, the last
scaling decision. The clock is a parameter. Knows nothing about I/O.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from inflight.operator import pod_health, render
from inflight.operator.autoscaler import Decision, Recommendation
from inflight.operator.spec import InferenceSpec


@dataclass(frozen=True, slots=True)
class Condition:
    type: str  # Ready | Available | Progressing | Degraded | MetricsUnavailable | AutoscalingConflict
    # | ForeignAutoscaler | AdaptersReady (``adapters``) | GroupsReady (``lws_status``) | PickerReady (``picker_health``)
    status: bool
    reason: str
    message: str


def rfc3339(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(text: object) -> float | None:
    """Seconds since the epoch of a UTC RFC 3339 time ("...Z", with or without fractional
    seconds, as this module writes them); None if not one."""
    if not isinstance(text, str):
        return None
    for fmt in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return datetime.datetime.strptime(text, fmt).replace(tzinfo=datetime.timezone.utc).timestamp()
        except ValueError:
            continue
    return None


def recommendations_status(history: tuple[Recommendation, ...]) -> list[dict[str, Any]]:
    """The autoscaler's recent recommendations for the status (millisecond times), so that a
    restarted operator keeps honouring the stabilization windows."""
    return [{"time": _rfc3339_ms(r.time), "replicas": r.replicas,
             **({"reason": r.reason, "message": r.message} if r.reason else {})} for r in history]


def _rfc3339_ms(ts: float) -> str:
    when = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


def recommendations_from_status(cr_status: dict[str, Any] | None) -> tuple[Recommendation, ...]:
    """The autoscaler history a previous operator left in the status (bad entries skipped)."""
    out = []
    for entry in (cr_status or {}).get("recommendations") or []:
        when = parse_rfc3339((entry or {}).get("time"))
        replicas = (entry or {}).get("replicas")
        if when is not None and isinstance(replicas, int) and not isinstance(replicas, bool):
            reason, message = (entry or {}).get("reason"), (entry or {}).get("message")
            out.append(Recommendation(time=when, replicas=replicas, reason=reason if isinstance(reason, str) else "",
                                      message=message if isinstance(message, str) else ""))
    return tuple(out)


def merge_conditions(
    existing: list[dict[str, Any]] | None, updates: list[Condition], now: float, generation: int | None
) -> list[dict[str, Any]]:
    """The full conditions list with ``updates`` applied (lists are replaced by merge patches)."""
    by_type = {c.get("type"): dict(c) for c in existing or [] if isinstance(c, dict)}
    for cond in updates:
        old = by_type.get(cond.type)
        status = "True" if cond.status else "False"
        changed = old is None or old.get("status") != status
        entry: dict[str, Any] = {
            "type": cond.type,
            "status": status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": rfc3339(now) if changed else old.get("lastTransitionTime", rfc3339(now)),
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        by_type[cond.type] = entry
    order = {"Ready": 0, "Available": 1, "Progressing": 2, "Degraded": 3}
    return sorted(by_type.values(), key=lambda c: (order.get(c["type"], 9), c["type"]))


def degraded_condition(found: pod_health.Failure | None) -> Condition:
    """``Degraded`` for a spec that applied: the pods' or the Deployment's failure, if any."""
    if found is None:
        return Condition("Degraded", False, "Reconciled", "all objects applied; no pod is failing")
    return Condition("Degraded", True, found.reason, found.message)


def refused_status(
    degraded: Condition, existing: list[dict[str, Any]] | None, applied_generation: int | None,
    generation: int | None, now: float,
) -> dict[str, Any]:
    """The status after a refused spec (``degraded``: the refusal's condition, reason InvalidSpec,
    ApplyRefused or ApplyFailed): ``observedGeneration`` stays the last generation that applied
    (``None``: none did); the conditions carry the refused ``generation``."""
    then = ("fix the spec" if degraded.reason == "InvalidSpec"
            else "the operator retries with backoff unless the answer was 400/422")
    conditions = [
        degraded,
        Condition("Progressing", False, degraded.reason, f"{then}; running pods keep the last spec that "
                  "applied, and autoscaling, drift repair and status continue with it"),
    ]
    return {
        "observedGeneration": applied_generation,
        "conditions": merge_conditions(existing, conditions, now, generation),
    }


def differs(current: dict[str, Any] | None, update: dict[str, Any]) -> bool:
    """Whether merge-patching ``update`` into ``current`` would change anything."""
    current = current or {}
    return any(current.get(key) != value for key, value in update.items())


def autoscaling_conflict(spec: InferenceSpec, cr_status: dict[str, Any] | None) -> tuple[int | None, Condition]:
    """(``status.autoscalingBaseReplicas`` to write, the AutoscalingConflict condition).

    The base is ``spec.replicas`` when autoscaling was turned on; while autoscaling stays on,
    ``spec.replicas`` moving away from it means someone scaled the resource (``kubectl scale``,
    an HPA, KEDA on the scale subresource) and the operator ignores it: say so.
    """
    if not spec.autoscaling.enabled:
        return None, Condition("AutoscalingConflict", False, "AutoscalingOff", "spec.replicas sets the replicas")
    base = (cr_status or {}).get("autoscalingBaseReplicas")
    if not isinstance(base, int) or isinstance(base, bool):
        base = spec.replicas
    if spec.replicas == base:
        return base, Condition("AutoscalingConflict", False, "NoConflict", "the operator's autoscaler sets the replicas")
    return base, Condition(
        "AutoscalingConflict", True, "ReplicasIgnored",
        f"spec.replicas was changed to {spec.replicas} (kubectl scale, an HPA or KEDA?) while "
        f"spec.autoscaling.enabled is true: it is ignored, the autoscaler keeps replicas between "
        f"{spec.autoscaling.min_replicas} and {spec.autoscaling.max_replicas}. Change minReplicas/maxReplicas, "
        f"set spec.replicas back to {base}, or turn autoscaling off to scale by hand.",
    )


def reconciled_status(
    spec: InferenceSpec, existing: list[dict[str, Any]] | None, generation: int | None, now: float,
    extra: list[Condition] | None = None,
) -> dict[str, Any]:
    conditions = [
        Condition("Degraded", False, "Reconciled", "all objects applied"),
        Condition("Progressing", True, "Reconciled", "Deployment, Service, PDB and live config applied"),
        *(extra or []),
    ]
    return {
        "observedGeneration": generation,
        "selector": render.selector_string(spec.name),
        "endpoint": render.endpoint_url(spec),
        "model": spec.model.served_model_name,
        "conditions": merge_conditions(existing, conditions, now, generation),
    }


def observed_status(
    deployment: dict[str, Any],
    decision: Decision | None,
    existing: list[dict[str, Any]] | None,
    generation: int | None,
    now: float,
    extra: list[Condition] | None = None,
) -> dict[str, Any]:
    """Replica counts from the Deployment, the decision (if one was made), the Ready (all
    replicas ready), Available (at least one) and Progressing conditions, plus ``extra``."""
    extra = extra or []
    desired = int((deployment.get("spec") or {}).get("replicas") or 0)
    dstatus = deployment.get("status") or {}
    ready = int(dstatus.get("readyReplicas") or 0)
    updated = int(dstatus.get("updatedReplicas") or 0)
    counts = f"{ready}/{desired} replicas ready"
    if desired == 0:
        cond = Condition("Ready", False, "ScaledToZero", "replicas is 0")
    elif ready >= desired:
        cond = Condition("Ready", True, "AllReplicasReady", counts)
    else:
        cond = Condition("Ready", False, "PartiallyReady" if ready else "NoReplicasReady", counts)
    available = Condition("Available", ready > 0, "MinimumReplicasAvailable" if ready else "NoReplicasReady", counts)
    progressing = Condition(
        "Progressing", updated < desired or ready < desired, "RollingOut" if updated < desired else "Stable",
        f"{updated}/{desired} replicas up to date",
    )
    status: dict[str, Any] = {
        "replicas": int(dstatus.get("replicas") or 0),
        "readyReplicas": ready,
        "desiredReplicas": desired,
        "conditions": merge_conditions(existing, [cond, available, progressing, *extra], now, generation),
    }
    if decision is not None:
        status["lastDecisionReason"] = decision.reason
        status["lastDecisionMessage"] = decision.message
        status["desiredReplicas"] = decision.desired
        status["kvCacheUsage"] = None if decision.kv_cache_usage is None else round(decision.kv_cache_usage, 4)
        status["queueDepth"] = None if decision.queue_depth is None else round(decision.queue_depth, 3)
        ttft = decision.ttft_backlog_seconds
        status["ttftBacklogSeconds"] = None if ttft is None else round(ttft, 3)
    return status
