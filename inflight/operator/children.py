"""Level-triggered checks of one InferenceDeployment's children, run by the timer.

Owns what "drifted" means and how often each child is read. A child drifted when it is gone,
when its ``inflight.dev/last-applied`` record is not what the spec renders now, or when the
fields the operator owns no longer hash to what the API server stored at the operator's last
write (``applied.fingerprint``: a mutating webhook's additions at that write are part of it, so
they cause no re-apply loop; a hand edit later is a change). Every tick reads the Deployment
(its status feeds the CR's) and the picker's Deployment (both held by the rollout gate); every ``config.full_check_every_ticks``-th tick reads the other
children too (all of them from the watch-fed caches, ``ctx.cache``: no API request unless a
cache cannot serve), re-creates a deleted admin Secret (by a create, answered 409 when it exists: the
operator may not read Secrets outside its own namespace) or model-cache PVC, and lists the
namespace's HorizontalPodAutoscalers for one that targets the Deployment (an HPA of one's own, or
KEDA's, which acts through one). Knows nothing about kopf or the status.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from inflight.operator import partners, reconcile, render, rollout_gate
from inflight.operator.applied import is_drifted
from inflight.operator.context import OperatorContext
from inflight.operator.kube import DEPLOYMENTS, HPAS, LEADER_WORKER_SETS, PVCS, SECRETS, KubeError
from inflight.operator.spec import InferenceSpec
from inflight.operator.status import Condition

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ChildCheck:
    """One tick's findings: the drifted children ("Kind/name"), the live Deployment, the
    Secret/PVC re-created, and the foreign autoscalers (``None``: not looked for this tick)."""

    drifted: list[str] = field(default_factory=list)
    deployment: dict[str, Any] | None = None
    created: list[str] = field(default_factory=list)
    foreign_autoscalers: tuple[str, ...] | None = None
    rollout_waiting: bool = False  # an operator-caused template change waits at the rollout gate


async def check(
    ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner, written: dict[str, str],
    full: bool, leave_replicas: bool, pending: bool = False, generation: int | None = None,
) -> ChildCheck:
    """Read the children (only the workload and the picker's Deployment unless ``full``) and say
    which drifted. Those are compared as the rollout gate would apply them (``generation``: the CR's that
    applied; a template the gate holds is no drift, ``rollout_waiting`` says it waits)."""
    out = ChildCheck()
    owner, key = await reconcile.keyed_owner(ctx, spec, owner)
    hold = rollout_gate.Hold(generation)
    rendered = reconcile.rendered_children(spec, owner, None, leave_replicas, hold)
    gated = {(g.kind, g.name): g for g in reconcile.gated_objects(spec, rendered)}  # the workload, the picker
    for kind, body, patch in rendered:
        name = body["metadata"]["name"]
        is_main = kind in (DEPLOYMENTS, LEADER_WORKER_SETS) and name == spec.name  # the workload
        if not (full or (kind, name) in gated):
            continue
        live = await ctx.cache.get(kind, spec.namespace, name)
        if is_main:
            out.deployment = live
        if (g := gated.get((kind, name))) is not None and (
                held := rollout_gate.held_template(live, g.rendered, generation)) is not None:
            out.rollout_waiting = True
            patch = rollout_gate.with_hold(patch, rollout_gate.Hold(generation, held))
        child = f"{body['kind']}/{name}"
        if is_drifted(live, patch, child, written, pending):
            out.drifted.append(child)
    if full:
        out.created = await ensure_created(ctx, spec, owner, key)
        try:
            out.foreign_autoscalers = await foreign_autoscalers(ctx, spec)
        except KubeError as exc:  # e.g. an older chart's RBAC: the rest of the round still runs
            logger.warning("cannot list HorizontalPodAutoscalers in %s (foreign autoscalers go unseen): %s",
                           spec.namespace, exc)
    return out


async def ensure_created(ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner, key: str) -> list[str]:
    """Re-create the admin Secret and the cache PVC when gone; what was created."""
    created = []
    secret = render.render_admin_secret(spec, owner, key)
    try:
        await ctx.kube.create(SECRETS, spec.namespace, secret)
        created.append(f"Secret/{secret['metadata']['name']}")
    except KubeError as exc:
        if exc.status != 409:
            raise
    if (pvc := render.render_cache_pvc(spec, owner)) is not None and \
            await ctx.cache.get(PVCS, spec.namespace, pvc["metadata"]["name"]) is None:
        if await ctx.kube.create_if_missing(PVCS, spec.namespace, pvc):
            created.append(f"PersistentVolumeClaim/{pvc['metadata']['name']}")
    return created


async def foreign_autoscalers(ctx: OperatorContext, spec: InferenceSpec) -> tuple[str, ...]:
    """HorizontalPodAutoscalers in the namespace whose target is the model's workload, but the
    partner's (``spec.autoscaling.partner``: the one it renders, or KEDA's from its ScaledObject)."""
    found = []
    partner = partners.hpa_name(spec.name, spec.autoscaling.partner) if spec.autoscaling.enabled else None
    for hpa in await ctx.cache.list(HPAS, spec.namespace, {}):
        target = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
        if target.get("kind") in ("Deployment", "LeaderWorkerSet") and target.get("name") == spec.name and \
                hpa["metadata"]["name"] != partner:
            found.append(f"HorizontalPodAutoscaler/{hpa['metadata']['name']}")
    return tuple(sorted(found))


def foreign_autoscaler_condition(names: tuple[str, ...], spec: InferenceSpec) -> Condition:
    if not names:
        return Condition("ForeignAutoscaler", False, "NoneFound",
                         "no HorizontalPodAutoscaler targets the Deployment")
    who = ", ".join(names)
    mine = "the operator's autoscaler is paused" if spec.autoscaling.enabled else "spec.replicas is not applied"
    return Condition(
        "ForeignAutoscaler", True, "ForeignAutoscaler",
        f"{who} targets Deployment {spec.name}: it sets the replicas now and {mine}, so the two do not "
        f"fight. Delete it (or point it, or KEDA's ScaledObject, at the InferenceDeployment's /scale) "
        f"to give the replicas back.")
