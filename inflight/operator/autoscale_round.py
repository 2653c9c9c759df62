"""One autoscaling round of one InferenceDeployment: scrape, decide, apply the replicas.

Owns the round (``autoscale``: the ready pods' /metrics behind their admin key, the decision from
``autoscaler``, the activator's demand at ``minReplicas: 0``, the replicas patched and an Event
when they change) and the ``MetricsUnavailable`` bookkeeping of rounds with a pod not scraped.
Called by ``tick``; the state it keeps is ``reconcile.ResourceState``'s.
"""

from __future__ import annotations

import logging
from typing import Any

from inflight.operator import activator_fleet, autoscaler, lws_status, metrics_scrape, operator_metrics, status
from inflight.operator.autoscaler import Decision, Observations, Policy
from inflight.operator.context import OperatorContext
from inflight.operator.reconcile import ResourceState
from inflight.operator.spec import InferenceSpec

logger = logging.getLogger(__name__)


def policy_of(spec: InferenceSpec) -> Policy:
    a = spec.autoscaling
    return Policy(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        target_kv_cache_usage=a.target_kv_cache_usage,
        target_queue_depth=a.target_queue_depth,
        target_ttft_seconds=a.target_ttft_seconds,
        scale_up_window_s=a.scale_up_stabilization_seconds,
        scale_down_window_s=a.scale_down_stabilization_seconds,
    )


async def autoscale(
    ctx: OperatorContext,
    spec: InferenceSpec,
    cr: dict[str, Any],
    deployment: dict[str, Any],
    pods: list[dict[str, Any]],
    state: ResourceState,
    now: float,
) -> Decision:
    """Scrape ready pods, decide, and apply the decision to the Deployment's replicas."""
    ready = [p for p in pods if metrics_scrape.pod_is_ready(p)]
    targets = [t for p in ready for t in [metrics_scrape.pod_target(p)] if t is not None]
    admin_key, _ = await ctx.admin_key(spec.namespace, spec.name)  # /metrics is behind the pods' keys
    scrapes = await metrics_scrape.scrape_pods(ctx.http, targets, ctx.config.pod_timeout_seconds, admin_key)
    no_ip = len(ready) - len(targets)
    metrics = tuple(s.metrics for s in scrapes)
    metrics += tuple(autoscaler.PodMetrics(f"no-ip-{i}", None, None) for i in range(no_ip))
    await _track_metrics(ctx, cr, state, [s.error for s in scrapes if s.error])
    current = int((deployment.get("spec") or {}).get("replicas") or 0)
    obs = Observations(current_replicas=current, ready=metrics, num_pending=max(0, current - len(ready)))
    policy = policy_of(spec)
    decision = autoscaler.decide(obs, policy, state.history, now)
    if spec.autoscaling.min_replicas == 0:  # the activator's demand decides 0 -> 1 and 1 -> 0
        decision = await activator_fleet.with_demand(ctx, spec, decision, current)
    operator_metrics.DECISIONS.labels(reason=decision.reason).inc()
    state.history = autoscaler.prune(state.history + (decision.recommendation,), policy, now)
    state.last_decision_at = now
    logger.info(
        "autoscaler %s/%s: %d -> %d (%s: %s)",
        spec.namespace, spec.name, current, decision.desired, decision.reason, decision.message,
    )
    if decision.desired != current and spec.autoscaling.partner is None:  # a partner writes them otherwise
        await ctx.kube.patch(lws_status.workload_kind(spec), spec.namespace, spec.name,
                             {"spec": {"replicas": decision.desired}})  # an LWS's replicas are groups
        state.last_scale_time = now
        state.replicas = decision.desired
        await ctx.kube.post_event(
            cr, "Normal", decision.reason,
            f"scaled {current} -> {decision.desired}: {decision.message}",
        )
    return decision


METRICS_FAILURE_ROUNDS = 3  # rounds in a row with an unscraped pod before MetricsUnavailable


async def _track_metrics(ctx: OperatorContext, cr: dict[str, Any], state: ResourceState, errors: list[str]) -> None:
    """Count rounds in a row where a ready pod gave no metrics; post a Warning Event when the
    count reaches METRICS_FAILURE_ROUNDS (the MetricsUnavailable condition follows it)."""
    if not errors:
        state.metrics_failed_rounds, state.metrics_error = 0, ""
        return
    operator_metrics.SCRAPE_FAILURES.inc(len(errors))
    state.metrics_failed_rounds += 1
    state.metrics_error = f"{len(errors)} pod(s) not scraped, e.g. {errors[0]}"
    if state.metrics_failed_rounds == METRICS_FAILURE_ROUNDS:
        await ctx.kube.post_event(
            cr, "Warning", "MetricsUnavailable",
            f"{state.metrics_error}; the autoscaler holds or counts them conservatively. The operator "
            "scrapes the runtime container's port named http: check NetworkPolicies and mesh mTLS.",
        )


def metrics_condition(state: ResourceState) -> status.Condition:
    if state.metrics_failed_rounds >= METRICS_FAILURE_ROUNDS:
        return status.Condition("MetricsUnavailable", True, "ScrapeFailed",
                                f"{state.metrics_failed_rounds} rounds in a row: {state.metrics_error}")
    return status.Condition("MetricsUnavailable", False, "Scraped", "every ready pod returned metrics")
