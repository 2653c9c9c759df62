"""One timer round for one InferenceDeployment, and the refusal bookkeeping the handlers share.

Owns the round's order: read the children (``children.check``: the Deployment every tick,
everything every Nth), repair what drifted (with backoff when the cluster refuses the repair),
push live config, sync the LoRA adapters (``adapters``), one autoscaling round when due
(paused while a foreign HPA owns the replicas), and the status, written only when it differs
from what the CR holds (the autoscaler's recommendation times, which move every round, are
refreshed at most every ``RECOMMENDATIONS_REFRESH_S``; ``PickerReady`` from the picker Deployment,
``picker_health``). Also owns how a refusal reaches the cluster: the ``Degraded``
condition the round keeps in place, and one Warning Event per distinct refusal
(``post_once``). Works from the last spec that applied (``ResourceState.good_spec``), so a
refused edit freezes nothing. Knows kopf only as the ``patch`` it fills.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf

from inflight.operator import (
    adapters,
    autoscale_round,
    children,
    lws_status,
    partners,
    picker_health,
    pod_events,
    reconcile,
    refusals,
    render,
    render_model,
    rollout_gate,
    scale_to_zero,
    status,
)
from inflight.operator.context import OperatorContext
from inflight.operator.kube import DEPLOYMENTS, KubeError
from inflight.operator.operator_metrics import DRIFT_REPAIRS, STATUS_WRITES
from inflight.operator.reconcile import ResourceState
from inflight.operator.refusals import Refusal
from inflight.operator.render_pool import picker_name

RECOMMENDATIONS_REFRESH_S = 60.0  # a restarted operator may see the windows end this much early
MAX_EVENT_KEYS = 64


def cr_ref(body: Any) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid", "")},
    }


def conditions_of(body: Any) -> list[dict[str, Any]]:
    return list((body.get("status") or {}).get("conditions") or [])


async def post_once(ctx: OperatorContext, body: Any, state: ResourceState, refusal: Refusal,
                    logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """A Warning Event for ``refusal`` unless this one was posted already (retries post none)."""
    if refusal.key in state.event_keys:
        return
    try:
        await ctx.kube.post_event(cr_ref(body), "Warning", refusal.reason, refusal.text())
    except KubeError as exc:  # the API server may be what is failing: the next retry posts it
        logger.warning("could not post the %s Event yet: %s", refusal.reason, exc)
        return
    if len(state.event_keys) >= MAX_EVENT_KEYS:
        state.event_keys.clear()
    state.event_keys.add(refusal.key)


async def _repair(ctx: OperatorContext, body: Any, spec: Any, owner: render.Owner, state: ResourceState,
                  drifted: list[str], logger: kopf.Logger, patch: kopf.Patch) -> dict[str, Any] | None:
    """Re-apply the children (through the rollout gate: ``drifted`` empty is a waiting rollout's
    retry); on a refusal, a condition, an Event and a retry after backoff."""
    now = time.monotonic()
    if now < state.repair_after:
        return await ctx.cache.get(lws_status.workload_kind(spec), spec.namespace, spec.name)
    if drifted:
        logger.info("repairing %s (gone or edited by hand)", ", ".join(drifted))
    try:
        gate = await reconcile.apply_through_gate(ctx, spec, owner, state, rollout_gate.Target(
            spec.namespace, spec.name, state.good_generation, rollout_gate.approved(body)), bool(drifted))
    except reconcile.SpecRejected as exc:
        refusal = exc.refusal(state.good_generation, during="repair")
        cfg = ctx.config
        state.repair_after = now + refusals.retry_delay(state.repair_failures, cfg.retry_base_seconds,
                                                        cfg.retry_max_seconds)
        state.repair_failures += 1
        if state.refusal is None or state.refusal.during == "repair":
            state.refusal = refusal
        logger.warning("could not repair the children: %s", refusal.text())
        await post_once(ctx, body, state, refusal, logger)
    else:
        if gate.approval_used:
            patch.metadata.annotations[rollout_gate.APPROVAL_ANNOTATION] = None  # used once
        for child in drifted:
            DRIFT_REPAIRS.labels(kind=child.partition("/")[0]).inc()
        state.repair_after, state.repair_failures = 0.0, 0
        if state.refusal is not None and state.refusal.during == "repair":
            state.refusal = None
    return await ctx.cache.get(lws_status.workload_kind(spec), spec.namespace, spec.name)  # as repaired


async def _note_foreign(ctx: OperatorContext, body: Any, state: ResourceState, found: tuple[str, ...],
                        spec: Any) -> None:
    if found and found != state.foreign_autoscalers:
        cond = children.foreign_autoscaler_condition(found, spec)
        await ctx.kube.post_event(cr_ref(body), "Warning", "ForeignAutoscaler", cond.message)
    state.foreign_autoscalers = found


async def run(body: Any, ctx: OperatorContext, state: ResourceState, patch: kopf.Patch, logger: kopf.Logger) -> None:
    """One round (see the module docstring)."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp"):
        return  # being deleted: the delete handler owns the children now
    degraded = next((c for c in conditions_of(body) if c.get("type") == "Degraded"), {})
    if state.handled_generation != meta.get("generation") or degraded.get("observedGeneration") != meta.get(
            "generation"):
        return  # the reconcile handler's status for this generation has not landed: it owns status then
    spec = state.good_spec  # a refused edit leaves the last spec that applied in charge
    if spec is None:
        return  # nothing applied by this operator yet: the reconcile handler owns creation
    reconcile.seed_from_status(state, body.get("status"))
    owner = render.Owner(name=spec.name, uid=meta.get("uid", ""))
    full = state.ticks % ctx.config.full_check_every_ticks == 0
    state.ticks += 1
    pending = state.refusal is not None and state.refusal.during == "spec"
    found = await children.check(ctx, spec, owner, state.written, full, bool(state.foreign_autoscalers), pending,
                                 state.good_generation)
    if found.foreign_autoscalers is not None:
        await _note_foreign(ctx, body, state, found.foreign_autoscalers, spec)
    for child in found.created:
        logger.info("re-created %s (deleted)", child)
        DRIFT_REPAIRS.labels(kind=child.partition("/")[0]).inc()
    deployment = found.deployment
    if found.drifted or (found.rollout_waiting and (full or rollout_gate.approved(body))):
        # level-triggered: a deleted or hand-edited child is put back; a waiting rollout asks again
        deployment = await _repair(ctx, body, spec, owner, state, found.drifted, logger, patch)
        if state.rollout is not None:
            found.rollout_waiting = state.rollout.waiting
    if deployment is None:  # gone, and putting it back was refused: say so
        if state.refusal is not None:
            update = {"conditions": status.merge_conditions(
                conditions_of(body), [state.refusal.condition()], time.time(), meta.get("generation"))}
            if status.differs(body.get("status"), update):
                patch.status.update(update)
        return
    pods = await reconcile.list_pods(ctx, spec)
    for error in await reconcile.sync_live_config(ctx, spec, state, pods):
        logger.warning("live config not pushed yet: %s", error)
    lora = await adapters.sync(ctx, spec, state.adapters, pods, cr_ref(body))
    now = time.time()
    decision = None
    autoscaling = spec.autoscaling.enabled and not state.foreign_autoscalers
    due = state.last_decision_at is None or now - state.last_decision_at >= spec.autoscaling.interval_seconds
    due = due or scale_to_zero.due_at_zero(spec, deployment)
    if autoscaling and due:
        decision = await autoscale_round.autoscale(ctx, spec, cr_ref(body), deployment, pods, state, now)
        partners.publish(spec.namespace, spec.name, decision.kv_cache_usage, decision.queue_depth,
                         decision.ttft_backlog_seconds)  # the signals an HPA or KEDA partner reads
        if spec.autoscaling.partner is None:  # a partner's replicas stand; the status shows the recommendation
            deployment.setdefault("spec", {})["replicas"] = decision.desired
    elif not spec.autoscaling.enabled:
        partners.unpublish(spec.namespace, spec.name)
    state.replicas = int((deployment.get("spec") or {}).get("replicas") or 0) or state.replicas
    extra = [autoscale_round.metrics_condition(state)] if autoscaling else []
    group_pods = await lws_status.group_pods(ctx, spec) if spec.nodes > 1 else pods  # workers too
    if state.refusal is not None:  # the refusal stays in Degraded until it clears
        extra.append(state.refusal.condition())
    else:  # the pods' failure (with the Events of pods stuck creating, read only then)
        extra.append(status.degraded_condition(await pod_events.failure(ctx.kube, spec.namespace, deployment,
                                                                        group_pods, now)))
    extra.append(children.foreign_autoscaler_condition(state.foreign_autoscalers, spec))
    if spec.nodes > 1:  # a LeaderWorkerSet: whether each group has all its pods (one being recreated)
        groups, state.ready_groups = lws_status.groups_condition(
            spec, int((deployment.get("spec") or {}).get("replicas") or 0), group_pods, state.ready_groups)
        extra.append(groups)
    extra += rollout_conditions(body, _waiting(state.rollout, ctx) if found.rollout_waiting else None)
    extra += await _picker_conditions(ctx, spec, body)
    if lora is not None:
        extra.append(lora[1])
    new_status = status.observed_status(deployment, decision, conditions_of(body), meta.get("generation"), now, extra)
    if state.last_scale_time is not None:
        new_status["lastScaleTime"] = status.rfc3339(state.last_scale_time)
    if spec.autoscaling.enabled:
        new_status["recommendations"] = status.recommendations_status(state.history)
    if (cache := render_model.cache_status(spec.name, spec.model, pods)) is not None:
        new_status["modelCache"] = cache
    if lora is not None:
        new_status["adapters"] = lora[0]
    elif (body.get("status") or {}).get("adapters") is not None:
        new_status["adapters"] = None  # LoRA turned off: the merge patch drops the old rows
    if _worth_writing(body.get("status"), new_status, state, now):
        STATUS_WRITES.labels(result="written").inc()
        state.status_written_at = now
        patch.status.update(new_status)
    else:
        STATUS_WRITES.labels(result="unchanged").inc()


async def _picker_conditions(ctx: OperatorContext, spec: Any, body: Any) -> list[status.Condition]:
    """``PickerReady`` (and ``Ready=False`` while a FailClose pool has no picker); False with
    ``NoPicker`` once the operator stops rendering one it reported on."""
    if not picker_health.watched(spec):
        if any(c.get("type") == picker_health.CONDITION for c in conditions_of(body)):
            return [status.Condition(picker_health.CONDITION, False, "NoPicker", "the operator renders no picker")]
        return []
    picker = picker_health.condition(spec, await ctx.cache.get(DEPLOYMENTS, spec.namespace, picker_name(spec.name)))
    override = picker_health.ready_override(spec, picker)
    return [picker] if override is None else [picker, override]


def rollout_conditions(body: Any, gate: rollout_gate.Gate | None) -> list[status.Condition]:
    """``RolloutPending`` while the rollout gate holds the model, False once it held it before
    (none at all on a CR the gate never held)."""
    if (gate is not None and gate.waiting) or any(c.get("type") == "RolloutPending" for c in conditions_of(body)):
        return [rollout_gate.pending_condition(gate)]
    return []


def _waiting(gate: rollout_gate.Gate | None, ctx: OperatorContext) -> rollout_gate.Gate:
    """The gate's last answer while it holds the model (after a restart, before it asked again:
    the answer its setting gives with the slots unknown)."""
    if gate is not None and gate.waiting:
        return gate
    limit = ctx.config.max_concurrent_rollouts
    if limit == rollout_gate.MANUAL:
        return rollout_gate.waiting_gate(limit, [])
    return rollout_gate.Gate(True, "WaitingForRolloutSlot", "the operator's pod template changed (a new operator "
                             f"version, runtime or picker image default, or root key): it waits for one of the "
                             f"maxConcurrentRollouts {limit} slots (asked again at the next full check)")


def _worth_writing(current: dict[str, Any] | None, new: dict[str, Any], state: ResourceState, now: float) -> bool:
    """Whether ``new`` changes the status; recommendations count by their replicas, their times
    are refreshed every RECOMMENDATIONS_REFRESH_S (they move every autoscaling round)."""
    rest = {k: v for k, v in new.items() if k != "recommendations"}
    if status.differs(current, rest):
        return True
    if "recommendations" not in new:
        return False
    held = [(r or {}).get("replicas") for r in (current or {}).get("recommendations") or []]
    if held != [r["replicas"] for r in new["recommendations"]]:
        return True
    return state.status_written_at is None or now - state.status_written_at >= RECOMMENDATIONS_REFRESH_S
