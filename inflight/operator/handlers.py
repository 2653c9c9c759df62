"""Thin kopf handlers for InferenceDeployment, registered onto a given kopf registry.

Owns the kopf wiring only: startup (settings, the OperatorContext in the operator memo),
login, cleanup, create/update/resume (parse the spec, apply children, push live config,
patch status), delete (delete children), a timer (status from the Deployment, live-config
drift, autoscaling every ``spec.autoscaling.intervalSeconds``) and a liveness probe. The
work itself is in ``reconcile``; the status shapes in ``status``.

Deletion runs behind the finalizer ``inflight.dev/finalizer`` so the children are deleted
explicitly (their owner references would let the garbage collector do it too). kopf puts a
finalizer on every object a timer runs for, so it cannot be left off; the chart's pre-delete
hook (``inflight.operator.uninstall``) takes it off every resource at ``helm uninstall``.

An invalid spec (or one whose objects the API server refuses, ``reconcile.SpecRejected``) sets
``Degraded=True`` and raises ``kopf.PermanentError``: no retry until
the spec changes again. ``register()`` takes the registry instead of using kopf's global
one so tests can run isolated operators; it is called on the default
registry in ``inflight.operator.kopf_main``, the module ``kopf run`` loads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import kopf

from inflight.operator import (
    leader,
    operator_metrics,
    pod_health,
    reconcile,
    render,
    render_model,
    status,
)
from inflight.operator.context import OperatorConfig, OperatorContext, default_login
from inflight.operator.crd import PLURAL
from inflight.operator.kube import DEPLOYMENTS
from inflight.operator.operator_metrics import DRIFT_REPAIRS, MANAGED, RECONCILES, TICK_ERRORS
from inflight.operator.reconcile import ResourceState
from inflight.operator.spec import InferenceSpec, parse_spec

RESOURCE = (render.API_GROUP, render.API_VERSION, PLURAL)


def _state(memo: kopf.Memo) -> ResourceState:
    if getattr(memo, "state", None) is None:
        memo.state = ResourceState()
    return memo.state


def _cr_ref(body: Any) -> dict[str, Any]:
    meta = body["metadata"]
    return {
        "apiVersion": body["apiVersion"],
        "kind": body["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "uid": meta.get("uid", "")},
    }


def _conditions(body: Any) -> list[dict[str, Any]]:
    return list((body.get("status") or {}).get("conditions") or [])


async def on_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="inflight.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="inflight.dev", key="last-handled-configuration"
    )
    settings.peering.standalone = True
    settings.posting.level = logging.WARNING
    if getattr(memo, "ctx", None) is None:
        memo.ctx = OperatorContext(OperatorConfig.from_env())
    settings.persistence.finalizer = memo.ctx.config.finalizer
    # Let a timer that is mid-round at shutdown finish its (time-bounded) pod calls.
    settings.background.instant_exit_timeout = memo.ctx.config.pod_timeout_seconds + 2.0
    if memo.ctx.login is None:
        memo.ctx.login = default_login(settings)
    if not getattr(memo, "metrics_started", False):
        memo.metrics_started = operator_metrics.start_from_env() is not None
    if memo.ctx.config.lease_name:
        await _lead(memo, logging.getLogger("inflight.operator"))


async def _lead(memo: kopf.Memo, logger: logging.Logger) -> None:
    """Block kopf's start until this replica holds the Lease (kopf watches nothing before its
    startup handlers return), then keep renewing it; losing it ends the process (``on_lease_lost``)."""
    ctx: OperatorContext = memo.ctx
    cfg = ctx.config
    conn = await asyncio.to_thread(ctx.login)  # kopf logs in only after startup
    if conn is None:
        raise kopf.PermanentError("no credentials for the leader-election Lease")
    ctx.set_connection(conn)
    elector = leader.LeaderElector(lambda: ctx.kube, leader.LeaseConfig(
        name=cfg.lease_name, namespace=cfg.lease_namespace, identity=cfg.identity,
        duration_s=cfg.lease_seconds, renew_every_s=cfg.lease_seconds / 3,
        retry_every_s=min(2.0, cfg.lease_seconds / 5)))
    async with leader.standby_health(cfg.liveness_port):
        await elector.acquire()
    memo.elector = elector
    memo.lease_task = asyncio.create_task(elector.keep(ctx.on_lease_lost))


async def on_login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo | None:
    conn = await asyncio.to_thread(memo.ctx.login)  # an exec plugin (gcloud, aws) runs for a second or so
    if conn is not None:
        memo.ctx.set_connection(conn)
    return conn


async def on_cleanup(memo: kopf.Memo, **_: Any) -> None:
    if (task := getattr(memo, "lease_task", None)) is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await memo.elector.release()  # the standby takes over now, not after the lease expires
    await memo.ctx.close()


async def on_probe(memo: kopf.Memo, **_: Any) -> bool:
    """Liveness detail: whether the operator has API credentials."""
    return getattr(memo, "ctx", None) is not None and memo.ctx.connection is not None


def _parse_or_degrade(body: Any, patch: kopf.Patch, now: float) -> InferenceSpec:
    meta = body["metadata"]
    try:
        return parse_spec(meta["name"], meta["namespace"], dict(body.get("spec") or {}))
    except ValueError as exc:
        RECONCILES.labels(result="invalid_spec").inc()
        patch.status.update(status.invalid_spec_status(str(exc), _conditions(body), meta.get("generation"), now))
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc


async def on_reconcile(
    body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, logger: kopf.Logger, **_: Any
) -> None:
    """create / update / resume: apply everything the spec describes."""
    now = time.time()
    spec = _parse_or_degrade(body, patch, now)
    ctx: OperatorContext = memo.ctx
    meta = body["metadata"]
    state = _state(memo)
    try:
        await reconcile.apply_children(ctx, spec, render.Owner(name=spec.name, uid=meta.get("uid", "")))
    except reconcile.SpecRejected as exc:  # e.g. a bad volume source; other API errors: kopf retries
        RECONCILES.labels(result="rejected").inc()
        patch.status.update(status.invalid_spec_status(str(exc), _conditions(body), meta.get("generation"), now))
        raise kopf.PermanentError(str(exc)) from exc
    RECONCILES.labels(result="applied").inc()
    if state.good_spec is None:
        MANAGED.inc()
    state.good_spec, state.good_generation = spec, meta.get("generation")
    pods = await reconcile.list_pods(ctx, spec)
    errors = await reconcile.sync_live_config(ctx, spec, state, pods)
    for error in errors:
        logger.warning("live config not pushed yet (the timer retries): %s", error)
    base, conflict = status.autoscaling_conflict(spec, body.get("status"))
    new_status = status.reconciled_status(spec, _conditions(body), meta.get("generation"), now, [conflict])
    new_status["autoscalingBaseReplicas"] = base
    if conflict.status and not _has_condition(body, "AutoscalingConflict", True):
        await ctx.kube.post_event(_cr_ref(body), "Warning", "AutoscalingConflict", conflict.message)
    patch.status.update(new_status)


def _has_condition(body: Any, ctype: str, value: bool) -> bool:
    want = "True" if value else "False"
    return any(c.get("type") == ctype and c.get("status") == want for c in _conditions(body))


async def on_delete(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    meta = body["metadata"]
    deleted = await reconcile.delete_children(memo.ctx, meta["name"], meta["namespace"], meta.get("uid", ""))
    if getattr(memo, "state", None) is not None and memo.state.good_spec is not None:
        MANAGED.dec()
    memo.state = None
    logger.info("deleted %s", ", ".join(deleted) or "nothing (already gone)")


async def on_tick(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    """Status from the Deployment, drift repair, live config, and an autoscaling round when due."""
    try:
        await _tick(body, memo, patch, logger)
    except Exception:
        TICK_ERRORS.inc()
        raise


async def _tick(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, logger: kopf.Logger) -> None:
    meta = body["metadata"]
    if (body.get("status") or {}).get("observedGeneration") != meta.get("generation"):
        return  # the reconcile handler has not handled this generation yet; it owns status then
    if meta.get("deletionTimestamp"):
        return  # being deleted: the delete handler owns the children now
    ctx: OperatorContext = memo.ctx
    state = _state(memo)
    spec = state.good_spec  # a bad edit (Degraded) leaves the last spec that applied in charge
    if spec is None:
        return  # nothing applied by this operator yet: the reconcile handler owns creation
    current = state.good_generation == meta.get("generation")
    reconcile.seed_from_status(state, body.get("status"))
    owner = render.Owner(name=spec.name, uid=meta.get("uid", ""))
    drifted, deployment = await reconcile.drifted_children(ctx, spec, owner)
    if drifted:  # level-triggered: a deleted or hand-edited child is put back
        logger.info("repairing %s (gone or edited by hand)", ", ".join(drifted))
        for child in drifted:
            DRIFT_REPAIRS.labels(kind=child.partition("/")[0]).inc()
        try:
            await reconcile.apply_children(ctx, spec, owner)
        except reconcile.SpecRejected as exc:
            logger.warning("could not repair the children: %s", exc)
        deployment = await ctx.kube.get(DEPLOYMENTS, spec.namespace, spec.name)  # as repaired
    if deployment is None:
        return
    pods = await reconcile.list_pods(ctx, spec)
    for error in await reconcile.sync_live_config(ctx, spec, state, pods):
        logger.warning("live config not pushed yet: %s", error)
    now = time.time()
    decision = None
    due = state.last_decision_at is None or now - state.last_decision_at >= spec.autoscaling.interval_seconds
    if spec.autoscaling.enabled and due:
        decision = await reconcile.autoscale(ctx, spec, _cr_ref(body), deployment, pods, state, now)
        deployment.setdefault("spec", {})["replicas"] = decision.desired
    extra = [reconcile.metrics_condition(state)] if spec.autoscaling.enabled else []
    if current:  # while a bad edit is pending, Degraded carries the spec error instead
        extra.append(status.degraded_condition(pod_health.failure(deployment, pods)))
    new_status = status.observed_status(
        deployment, decision, _conditions(body), meta.get("generation"), now, extra)
    if state.last_scale_time is not None:
        new_status["lastScaleTime"] = status.rfc3339(state.last_scale_time)
    if spec.autoscaling.enabled:
        new_status["recommendations"] = status.recommendations_status(state.history)
    if (cache := render_model.cache_status(spec.name, spec.model, pods)) is not None:
        new_status["modelCache"] = cache
    patch.status.update(new_status)


def register(registry: kopf.OperatorRegistry, tick_seconds: float | None = None) -> None:
    """Register every handler onto ``registry`` (the timer runs every ``tick_seconds``)."""
    tick = tick_seconds if tick_seconds is not None else OperatorConfig.from_env().tick_seconds
    kopf.on.startup(registry=registry)(on_startup)
    kopf.on.login(registry=registry)(on_login)
    kopf.on.cleanup(registry=registry)(on_cleanup)
    kopf.on.probe(registry=registry, id="logged_in")(on_probe)
    kopf.on.create(*RESOURCE, registry=registry, id="reconcile")(on_reconcile)
    kopf.on.update(*RESOURCE, registry=registry, id="reconcile")(on_reconcile)
    kopf.on.resume(*RESOURCE, registry=registry, id="reconcile")(on_reconcile)
    kopf.on.delete(*RESOURCE, registry=registry, id="delete")(on_delete)
    kopf.timer(*RESOURCE, registry=registry, id="tick", interval=tick)(on_tick)
