"""The steps handlers run: apply children, push live config, one autoscaling round.

Owns the order of operations and the per-resource state between timer ticks
(``ResourceState``). Every Kubernetes call goes through ``KubeClient``, every pod call
through ``metrics_scrape``; what to write comes from ``render``, what to decide from
``autoscaler``. Knows nothing about kopf beyond being called by ``handlers``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from inflight.operator import (
    applied,
    autoscaler,
    engine_args,
    metrics_scrape,
    operator_metrics,
    render,
    status,
)
from inflight.operator.autoscaler import Decision, Observations, Policy, Recommendation
from inflight.operator.context import OperatorContext
from inflight.operator.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    INFERENCE_POOLS,
    PDBS,
    PODS,
    PVCS,
    SECRETS,
    SERVICES,
    Kind,
    KubeError,
)
from inflight.operator.render_pool import picker_name
from inflight.operator.spec import InferenceSpec

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ResourceState:
    """What the operator remembers about one InferenceDeployment between ticks (in memory)."""

    history: tuple[Recommendation, ...] = ()
    last_decision_at: float | None = None
    last_scale_time: float | None = None
    seeded: bool = False  # history and last scale time read back from the status once
    live_pushed: dict[str, str] = field(default_factory=dict)  # pod name -> live-config key
    # The last spec whose children applied, and its generation: the timer works from it, so a
    # bad edit does not freeze autoscaling or drift repair of a running service.
    good_spec: InferenceSpec | None = None
    good_generation: int | None = None
    metrics_failed_rounds: int = 0  # consecutive autoscaling rounds with a pod not scraped
    metrics_error: str = ""


class SpecRejected(Exception):
    """The API server refused what the spec rendered: retrying the same spec cannot help."""


async def apply_children(ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner) -> None:
    """Create or merge-patch the ConfigMap, Deployment, Service and PDB (idempotent); create the
    admin Secret (replaced when the pods' key id is not the root key's: an older scheme or a
    new root) and the model-cache PVC only when missing (never resized).

    Raises ``SpecRejected`` when the API server refuses an object as invalid (400/422) or does
    not know the InferencePool kind; other API errors propagate (kopf retries them).
    """
    try:
        await _apply_children(ctx, spec, owner)
    except KubeError as exc:
        if exc.status in (400, 422):
            raise SpecRejected(f"the API server rejected an object: {exc}") from exc
        raise


async def keyed_owner(ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner) -> tuple[render.Owner, str]:
    """``owner`` with the root key's id, and the resource's admin key."""
    key, key_id = await ctx.admin_key(spec.namespace, spec.name)
    return dataclasses.replace(owner, admin_key_id=key_id), key


async def _apply_admin_secret(ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner, key: str) -> None:
    """Create ``<name>-admin`` with the derived key; when the live pods were rendered for
    another key id (or none: the older random-key scheme), replace it first. The operator
    cannot read Secrets outside its namespace, so the Deployment's annotation is the record."""
    kube, ns = ctx.kube, spec.namespace
    admin = render.render_admin_secret(spec, owner, key)
    live = await kube.get(DEPLOYMENTS, ns, spec.name)
    if live is not None:
        template = ((live.get("spec") or {}).get("template") or {}).get("metadata") or {}
        if (template.get("annotations") or {}).get(render.ADMIN_KEY_ID_ANNOTATION) != owner.admin_key_id:
            if await kube.delete(SECRETS, ns, admin["metadata"]["name"]):
                logger.info("replacing admin Secret %s/%s (new key id %s; the pods roll)",
                            ns, admin["metadata"]["name"], owner.admin_key_id)
    try:
        await kube.create(SECRETS, ns, admin)
        logger.info("created admin Secret %s/%s", ns, admin["metadata"]["name"])
    except KubeError as exc:
        if exc.status != 409:  # exists, written by this scheme with this key id
            raise


async def _apply_children(ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner) -> None:
    kube, ns = ctx.kube, spec.namespace
    owner, key = await keyed_owner(ctx, spec, owner)
    await _apply_admin_secret(ctx, spec, owner, key)
    if (pvc := render.render_cache_pvc(spec, owner)) is not None:
        await kube.create_if_missing(PVCS, ns, pvc)
    children = rendered_children(spec, owner)
    for kind, body, patch in children:
        try:
            await kube.apply(kind, ns, body, patch)
        except KubeError as exc:
            if exc.status == 404 and body["kind"] == "InferencePool":
                raise SpecRejected(
                    "spec.inferencePool is enabled but the API server has no InferencePool kind "
                    "(inference.networking.k8s.io/v1): install the Gateway API Inference Extension CRDs "
                    "or set inferencePool.enabled: false"
                ) from exc
            raise
    wanted = {(body["kind"], body["metadata"]["name"]) for _, body, _ in children}
    for kind, obj_name in pool_children(spec.name):  # turned off, or an existing picker named now
        if (kind.kind, obj_name) not in wanted and await kube.get(kind, ns, obj_name) is not None:
            await kube.delete(kind, ns, obj_name)


def rendered_children(spec: InferenceSpec, owner: render.Owner) -> list[tuple[Kind, dict[str, Any], dict[str, Any]]]:
    """(kind, object to create, merge patch to apply) for every child the spec describes
    (the admin Secret and cache PVC aside: they are created once, never re-applied)."""
    deployment = render.render_deployment(spec, owner, render.initial_replicas(spec))
    out: list[tuple[Kind, dict[str, Any], dict[str, Any]]] = [
        (CONFIGMAPS, cm := render.render_configmap(spec, owner), cm),
        (DEPLOYMENTS, deployment, render.deployment_patch(deployment, spec.autoscaling.enabled)),
        (SERVICES, svc := render.render_service(spec, owner), svc),
        (PDBS, pdb := render.render_pdb(spec, owner), pdb),
    ]
    kinds = {"InferencePool": INFERENCE_POOLS, "Deployment": DEPLOYMENTS, "Service": SERVICES}
    out += [(kinds[obj["kind"]], obj, obj) for obj in render.render_pool_objects(spec, owner)]
    return out


def seed_from_status(state: ResourceState, cr_status: dict[str, Any] | None) -> None:
    """After an operator (re)start: the autoscaler history and last scale time the previous
    operator wrote into the status, so a scale-down window survives the restart."""
    if state.seeded:
        return
    state.seeded = True
    if not state.history:
        state.history = status.recommendations_from_status(cr_status)
    if state.last_scale_time is None:
        state.last_scale_time = status.parse_rfc3339((cr_status or {}).get("lastScaleTime"))


async def drifted_children(
    ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner
) -> tuple[list[str], dict[str, Any] | None]:
    """The children that are gone or no longer hold what the spec sets (a hand edit, a
    deletion): "Kind/name" of each; and the live Deployment as read (the tick's status comes
    from it when nothing drifted). One read per child."""
    out, deployment = [], None
    owner, _ = await keyed_owner(ctx, spec, owner)
    for kind, body, patch in rendered_children(spec, owner):
        name = body["metadata"]["name"]
        live = await ctx.kube.get(kind, spec.namespace, name)
        if kind == DEPLOYMENTS and name == spec.name:
            deployment = live
        if applied.drifted(live, applied.without_nulls(patch)):
            out.append(f"{body['kind']}/{name}")
    return out, deployment


def pool_children(name: str) -> list[tuple[Kind, str]]:
    """What ``inferencePool`` may create: the pool and the picker's Deployment and Service."""
    return [(INFERENCE_POOLS, name), (DEPLOYMENTS, picker_name(name)), (SERVICES, picker_name(name))]


async def delete_children(ctx: OperatorContext, name: str, namespace: str, uid: str = "") -> list[str]:
    """Delete what the operator created (owner references would GC it too); returns kinds deleted.

    The admin Secret (the operator's: it writes the derived key there) goes by name; the
    cache PVC only when this resource owns it (one a user made beforehand is left alone).
    """
    deleted = []
    for kind, obj_name in (
        (DEPLOYMENTS, name), (SERVICES, name), (PDBS, name), (CONFIGMAPS, render.configmap_name(name)),
        *pool_children(name),
    ):
        if await ctx.kube.delete(kind, namespace, obj_name):
            deleted.append(kind.kind)
    if await ctx.kube.delete(SECRETS, namespace, render.admin_secret_name(name)):
        deleted.append(SECRETS.kind)
    for kind, obj_name in ((PVCS, f"{name}-model-cache"),):
        obj = await ctx.kube.get(kind, namespace, obj_name)
        owners = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
        if uid and any(o.get("uid") == uid for o in owners) and await ctx.kube.delete(kind, namespace, obj_name):
            deleted.append(kind.kind)
    return deleted


def live_key(spec: InferenceSpec) -> str:
    return json.dumps(engine_args.live_values(spec.engine), sort_keys=True)


async def list_pods(ctx: OperatorContext, spec: InferenceSpec) -> list[dict[str, Any]]:
    return await ctx.kube.list(PODS, spec.namespace, render.selector_labels(spec.name))


async def sync_live_config(
    ctx: OperatorContext, spec: InferenceSpec, state: ResourceState, pods: list[dict[str, Any]]
) -> list[str]:
    """POST the live knobs to every ready pod that has not confirmed them yet; returns errors."""
    key = live_key(spec)
    targets = [
        t for p in pods if metrics_scrape.pod_is_ready(p)
        for t in [metrics_scrape.pod_target(p)] if t is not None and state.live_pushed.get(t.name) != key
    ]
    if not targets:
        return []
    api_key, _ = await ctx.admin_key(spec.namespace, spec.name)
    values = engine_args.live_values(spec.engine)
    errors = []
    for target in targets:
        error = await metrics_scrape.push_live_config(
            ctx.http, target, values, api_key, ctx.config.pod_timeout_seconds
        )
        if error is None:
            state.live_pushed[target.name] = key
            logger.info("live config %s pushed to pod %s", values, target.name)
        else:
            errors.append(error)
    live_names = {p["metadata"]["name"] for p in pods}
    for gone in set(state.live_pushed) - live_names:
        del state.live_pushed[gone]
    return errors


def policy_of(spec: InferenceSpec) -> Policy:
    a = spec.autoscaling
    return Policy(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        target_kv_cache_usage=a.target_kv_cache_usage,
        target_queue_depth=a.target_queue_depth,
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
    operator_metrics.DECISIONS.labels(reason=decision.reason).inc()
    state.history = autoscaler.prune(state.history + (decision.recommendation,), policy, now)
    state.last_decision_at = now
    logger.info(
        "autoscaler %s/%s: %d -> %d (%s: %s)",
        spec.namespace, spec.name, current, decision.desired, decision.reason, decision.message,
    )
    if decision.desired != current:
        await ctx.kube.patch(DEPLOYMENTS, spec.namespace, spec.name, {"spec": {"replicas": decision.desired}})
        state.last_scale_time = now
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
