"""Thin kopf handlers for InferenceDeployment, registered onto a given kopf registry.

Owns the kopf wiring only: startup (settings, the OperatorContext in the operator memo),
login, cleanup, create/update/resume (parse the spec, apply children, push live config,
patch status), delete (delete children), a timer (status from the Deployment, live-config
drift, autoscaling every ``spec.autoscaling.intervalSeconds``: ``tick``) and a liveness probe. The
work itself is in ``reconcile``; the status shapes in ``status``.

Deletion runs behind the finalizer ``inflight.dev/finalizer`` so the children are deleted
explicitly (their owner references would let the garbage collector do it too). kopf puts a
finalizer on every object a timer runs for, so it cannot be left off; the chart's pre-delete
hook (``inflight.operator.uninstall``) takes it off every resource at ``helm uninstall``.

A refused spec (the parser's ``InvalidSpec``, or any API error while applying it:
``reconcile.SpecRejected``) sets ``Degraded=True`` with the reason and the API server's answer,
keeps ``observedGeneration`` at the last generation that applied, and posts one Warning Event
(``refusals``, ``tick.post_once``: kopf posts no Event when a handler fails, and none at all for
the timer, whose logger is local). 400/422 raise ``kopf.PermanentError`` (no retry until the spec
changes); every other refusal ``kopf.TemporaryError`` with an exponential backoff. The timer
(``tick``) keeps working from the last spec that applied meanwhile (after an operator restart:
the spec in kopf's diff-base annotation, ``_adopt_last_handled``). ``register()`` takes the
registry instead of using kopf's global one so tests can run isolated operators; it is called
on the default registry in ``inflight.operator.kopf_main``, the module ``kopf run`` loads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import kopf

from inflight.operator import (
    leader,
    operator_metrics,
    partners,
    reconcile,
    refusals,
    render,
    rollout_gate,
    status,
    tick,
)
from inflight.operator.context import OperatorConfig, OperatorContext, default_login
from inflight.operator.crd import PLURAL
from inflight.operator.operator_metrics import MANAGED, RECONCILES, REFUSALS, TICK_ERRORS, TICKS
from inflight.operator.reconcile import ResourceState
from inflight.operator.refusals import Refusal
from inflight.operator.spec import parse_spec

RESOURCE = (render.API_GROUP, render.API_VERSION, PLURAL)
LAST_HANDLED = "inflight.dev/last-handled-configuration"  # kopf's diff base: the last spec handled


def _state(memo: kopf.Memo) -> ResourceState:
    if getattr(memo, "state", None) is None:
        memo.state = ResourceState()
    return memo.state


async def on_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="inflight.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="inflight.dev", key=LAST_HANDLED.partition("/")[2]
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


def _adopt_last_handled(body: Any, state: ResourceState) -> None:
    """After an operator restart, while the current spec is refused: the last spec kopf saw
    handled (its diff base annotation), so the timer keeps the running service going with it.
    Not when that is the refused spec itself (kopf stores a permanently failed one too)."""
    meta = body["metadata"]
    text = (meta.get("annotations") or {}).get(LAST_HANDLED)
    applied_generation = (body.get("status") or {}).get("observedGeneration")
    if state.good_spec is not None or not text or not isinstance(applied_generation, int):
        return
    try:
        old = json.loads(text).get("spec") or {}
        spec = parse_spec(meta["name"], meta["namespace"], dict(old))
    except (ValueError, AttributeError, TypeError):
        return
    if old == body.get("spec"):
        return
    state.good_spec, state.good_generation = spec, applied_generation
    MANAGED.inc()


async def _refused(ctx: OperatorContext, body: Any, patch: kopf.Patch, state: ResourceState, refusal: Refusal,
                   logger: kopf.Logger) -> None:
    """A refused spec: the Degraded condition (observedGeneration stays what applied), one Event."""
    _adopt_last_handled(body, state)
    state.refusal = refusal
    applied_generation = state.good_generation  # after a restart with nothing adopted: what the CR says
    if applied_generation is None:
        applied_generation = (body.get("status") or {}).get("observedGeneration")
    patch.status.update(status.refused_status(
        refusal.condition(), tick.conditions_of(body), applied_generation, refusal.generation, time.time()))
    if refusal.reason != "InvalidSpec":
        REFUSALS.labels(reason=refusal.reason, code=str(refusal.code)).inc()
    await tick.post_once(ctx, body, state, refusal, logger)


async def on_reconcile(
    body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, logger: kopf.Logger, retry: int = 0, **_: Any
) -> None:
    """create / update / resume: apply everything the spec describes. A refusal becomes the
    Degraded condition and an Event; 400/422 wait for the next spec change, anything else is
    retried by kopf after ``refusals.retry_delay`` (the timer keeps the running spec going)."""
    now = time.time()
    ctx: OperatorContext = memo.ctx
    meta = body["metadata"]
    state = _state(memo)
    generation = meta.get("generation")
    state.handled_generation = generation
    try:
        spec = parse_spec(meta["name"], meta["namespace"], dict(body.get("spec") or {}))
    except ValueError as exc:
        RECONCILES.labels(result="invalid_spec").inc()
        await _refused(ctx, body, patch, state, refusals.invalid_spec(str(exc), generation), logger)
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    owner = render.Owner(name=spec.name, uid=meta.get("uid", ""))
    try:
        gate = await reconcile.apply_through_gate(ctx, spec, owner, state, rollout_gate.Target(
            spec.namespace, spec.name, generation, rollout_gate.approved(body)))
    except reconcile.SpecRejected as exc:
        RECONCILES.labels(result="rejected" if exc.permanent else "refused").inc()
        refusal = exc.refusal(generation)
        await _refused(ctx, body, patch, state, refusal, logger)
        if exc.permanent:
            raise kopf.PermanentError(refusal.text()) from exc
        cfg = ctx.config
        delay = refusals.retry_delay(retry, cfg.retry_base_seconds, cfg.retry_max_seconds)
        raise kopf.TemporaryError(f"{refusal.text()}; next try in {delay:g} s", delay=delay) from exc
    RECONCILES.labels(result="applied").inc()
    if state.good_spec is None:
        MANAGED.inc()
    state.good_spec, state.good_generation = spec, generation
    state.refusal = None
    state.event_keys.clear()
    pods = await reconcile.list_pods(ctx, spec)
    errors = await reconcile.sync_live_config(ctx, spec, state, pods)
    for error in errors:
        logger.warning("live config not pushed yet (the timer retries): %s", error)
    base, conflict = status.autoscaling_conflict(spec, body.get("status"))
    extra = [conflict, *tick.rollout_conditions(body, gate)]
    if gate.approval_used:
        patch.metadata.annotations[rollout_gate.APPROVAL_ANNOTATION] = None  # used once
    new_status = status.reconciled_status(spec, tick.conditions_of(body), generation, now, extra)
    new_status["autoscalingBaseReplicas"] = base
    if conflict.status and not _has_condition(body, "AutoscalingConflict", True):
        await ctx.kube.post_event(tick.cr_ref(body), "Warning", "AutoscalingConflict", conflict.message)
    patch.status.update(new_status)


def _has_condition(body: Any, ctype: str, value: bool) -> bool:
    want = "True" if value else "False"
    return any(c.get("type") == ctype and c.get("status") == want for c in tick.conditions_of(body))


async def on_delete(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    meta = body["metadata"]
    deleted = await reconcile.delete_children(memo.ctx, meta["name"], meta["namespace"], meta.get("uid", ""))
    partners.unpublish(meta["namespace"], meta["name"])  # its signals' series go with it
    if getattr(memo, "state", None) is not None and memo.state.good_spec is not None:
        MANAGED.dec()
    memo.state = None
    logger.info("deleted %s", ", ".join(deleted) or "nothing (already gone)")


async def on_tick(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, logger: kopf.Logger, **_: Any) -> None:
    """Status from the Deployment, drift repair, live config, and an autoscaling round when due."""
    TICKS.inc()
    try:
        await tick.run(body, memo.ctx, _state(memo), patch, logger)
    except Exception:
        TICK_ERRORS.inc()
        raise


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
    # A failed round (the API server unreachable) is retried at the next tick, not after kopf's 60 s.
    kopf.timer(*RESOURCE, registry=registry, id="tick", interval=tick, backoff=tick)(on_tick)
