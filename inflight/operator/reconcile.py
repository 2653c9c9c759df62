"""The steps handlers run: apply children and push live config (one autoscaling round: ``autoscale_round``).

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
    engine_args,
    lws_status,
    metrics_scrape,
    refusals,
    render,
    render_lws,
    render_partners,
    rollout_gate,
    status,
)
from inflight.operator.adapters import AdapterState
from inflight.operator.autoscaler import Recommendation
from inflight.operator.context import OperatorContext
from inflight.operator.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    INFERENCE_POOLS,
    LEADER_WORKER_SETS,
    PDBS,
    PODS,
    PVCS,
    ROLE_BINDINGS,
    SECRETS,
    SERVICE_ACCOUNTS,
    SERVICES,
    Kind,
    KubeError,
)
from inflight.operator.refusals import Refusal
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
    handled_generation: int | None = None  # the generation the reconcile handler last handled
    refusal: Refusal | None = None  # what the cluster last refused (cleared by the next success)
    event_keys: set[tuple[object, ...]] = field(default_factory=set)  # refusals already posted as Events
    # "Kind/name" -> fingerprint of the fields the operator owns, as the API server stored them
    # after its last write (a mutating webhook's additions included): drift is a change of it.
    written: dict[str, str] = field(default_factory=dict)
    ticks: int = 0  # timer rounds so far (every config.full_check_every_ticks-th reads every child)
    replicas: int | None = None  # the Deployment's replicas as last seen or set (re-created at it)
    foreign_autoscalers: tuple[str, ...] = ()  # HPAs (or KEDA's) that target a child Deployment
    status_written_at: float | None = None  # when the timer last wrote the status
    repair_after: float = 0.0  # monotonic time before which a refused repair is not retried
    repair_failures: int = 0  # refused repairs in a row (the backoff's exponent)
    adapters: AdapterState = field(default_factory=AdapterState)  # LoRA load refusals and Events posted
    rollout: rollout_gate.Gate | None = None  # the rollout gate's last answer (``rollout_gate``)
    ready_groups: frozenset[str] = frozenset()  # spec.nodes > 1: groups seen ready (``lws_status``)


class SpecRejected(Exception):
    """The API server refused an object the spec rendered (``error``); ``permanent``: a 400/422
    or a missing kind, which only a spec change can help; otherwise a retry may succeed."""

    def __init__(self, error: KubeError, permanent: bool, hint: str = "", reason: str = "") -> None:
        super().__init__(hint or str(error))
        self.error = error
        self.permanent = permanent
        self.hint = hint
        self.reason = reason  # the Degraded reason when not the status code's (``refusals.from_error``)

    def refusal(self, generation: int | None, during: str = "spec") -> Refusal:
        return refusals.from_error(self.error, generation, during, self.hint, self.reason)


async def apply_children(
    ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner, written: dict[str, str] | None = None,
    replicas: int | None = None, leave_replicas: bool = False, hold: rollout_gate.Hold | None = None,
) -> None:
    """Create or merge-patch the ConfigMap, Deployment, Service and PDB (idempotent; a child the
    watch-fed cache holds as rendered is not written at all); create the
    admin Secret (replaced when the pods' key id is not the root key's: an older scheme or a
    new root) and the model-cache PVC only when missing (never resized). A created Deployment
    gets ``replicas`` (the autoscaler's count) when given; ``leave_replicas``: never patch them
    (a foreign HPA owns them); ``hold``: the CR generation and, while the rollout gate holds an
    operator-caused change, the recorded pod template (``rollout_gate``). ``written``: each child's
    fingerprint as written (``ResourceState.written``), a partial apply's too. Stale partner objects go.

    Raises ``SpecRejected`` for every API error (``permanent`` for 400/422 and a missing
    InferencePool kind).
    """
    try:
        await _apply_children(ctx, spec, owner, {} if written is None else written, replicas, leave_replicas, hold)
    except KubeError as exc:
        raise SpecRejected(exc, exc.status in refusals.PERMANENT_CODES) from exc


async def keyed_owner(ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner) -> tuple[render.Owner, str]:
    """``owner`` with the root key's id, and the resource's admin key."""
    key, key_id = await ctx.admin_key(spec.namespace, spec.name)
    return dataclasses.replace(owner, admin_key_id=key_id), key


async def _apply_admin_secret(ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner, key: str,
                              replace: bool = True) -> None:
    """Create ``<name>-admin`` with the derived key; when the live pods were rendered for
    another key id (or none: the older random-key scheme), replace it first. The operator
    cannot read Secrets outside its namespace, so the Deployment's annotation is the record."""
    kube, ns = ctx.kube, spec.namespace
    admin = render.render_admin_secret(spec, owner, key)
    live = await ctx.cache.get(lws_status.workload_kind(spec), ns, spec.name)
    if live is not None and replace:  # not while the rollout gate holds the template (and its key id)
        template = lws_status.pod_template(live).get("metadata") or {}
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


async def _apply_children(
    ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner, written: dict[str, str],
    replicas: int | None, leave_replicas: bool, hold: rollout_gate.Hold | None = None,
) -> None:
    kube, ns = ctx.kube, spec.namespace
    owner, key = await keyed_owner(ctx, spec, owner)
    await _apply_admin_secret(ctx, spec, owner, key, replace=hold is None or hold.template is None)
    if (pvc := render.render_cache_pvc(spec, owner)) is not None:
        await kube.create_if_missing(PVCS, ns, pvc)
    children = rendered_children(spec, owner, replicas, leave_replicas, hold)
    for kind, body, patch in children:
        key = f"{body['kind']}/{body['metadata']['name']}"
        live = await ctx.informers.get(kind, ns, body["metadata"]["name"]) if ctx.informers is not None else None
        if live is not None and not applied.is_drifted(live, patch, key, written):
            continue  # the cache holds it as rendered: nothing to write
        try:
            stored = await kube.apply(kind, ns, body, patch, live)
        except KubeError as exc:
            if exc.status == 404 and body["kind"] == "InferencePool":
                raise SpecRejected(exc, True, (
                    "spec.inferencePool is enabled but the API server has no InferencePool kind "
                    "(inference.networking.k8s.io/v1): install the Gateway API Inference Extension CRDs "
                    "or set inferencePool.enabled: false")) from exc
            if exc.status == 404 and body["kind"] == "LeaderWorkerSet":  # retried: it may be installed later
                raise SpecRejected(exc, False, lws_status.missing_hint(spec), lws_status.MISSING_REASON) from exc
            raise
        written[key] = applied.fingerprint(stored)
    wanted = {(body["kind"], body["metadata"]["name"]) for _, body, _ in children}
    if spec.nodes > 1 and await ctx.cache.get(DEPLOYMENTS, ns, spec.name) is not None:  # the LWS replaced it
        await kube.delete(DEPLOYMENTS, ns, spec.name)
    for kind, obj_name in pool_children(spec.name):  # turned off, or an existing picker named now
        if (kind.kind, obj_name) not in wanted and await ctx.cache.get(kind, ns, obj_name) is not None:
            await kube.delete(kind, ns, obj_name)
    await render_partners.delete_stale(kube, spec, owner.uid)  # autoscaling.partner off or changed


def rendered_children(
    spec: InferenceSpec, owner: render.Owner, replicas: int | None = None, leave_replicas: bool = False,
    hold: rollout_gate.Hold | None = None,
) -> list[tuple[Kind, dict[str, Any], dict[str, Any]]]:
    """(kind, object to create, merge patch) per child (not the admin Secret and cache PVC: created
    once, never re-applied); an autoscaled Deployment is created at ``replicas`` when given."""
    count = render.initial_replicas(spec)
    if replicas is not None and spec.autoscaling.enabled:
        count = min(max(replicas, spec.autoscaling.min_replicas), spec.autoscaling.max_replicas)
    leave = spec.autoscaling.enabled or leave_replicas
    if spec.nodes > 1:  # a LeaderWorkerSet of groups instead (gated alike: ``rollout_gate.gated_part``)
        lws = rollout_gate.with_hold(render_lws.render_leader_worker_set(spec, owner, count), hold)
        workload = (LEADER_WORKER_SETS, lws, rollout_gate.with_hold(render_lws.lws_patch(lws, leave), hold))
    else:
        deployment = rollout_gate.with_hold(render.render_deployment(spec, owner, count), hold)
        workload = (DEPLOYMENTS, deployment, rollout_gate.with_hold(render.deployment_patch(deployment, leave), hold))
    out: list[tuple[Kind, dict[str, Any], dict[str, Any]]] = [
        (CONFIGMAPS, cm := render.render_configmap(spec, owner), cm),
        workload,
        (SERVICES, svc := render.render_service(spec, owner), svc),
        (PDBS, pdb := render.render_pdb(spec, owner), pdb),
    ]
    kinds = {"InferencePool": INFERENCE_POOLS, "Deployment": DEPLOYMENTS, "Service": SERVICES,
             "ServiceAccount": SERVICE_ACCOUNTS, "RoleBinding": ROLE_BINDINGS}
    picker_hold = hold.for_picker() if hold is not None else None
    for obj in render.render_pool_objects(spec, owner):
        if obj["kind"] == "Deployment":  # the picker's: the rollout gate holds it like the workload
            obj = rollout_gate.with_hold(obj, picker_hold)
        out.append((kinds[obj["kind"]], obj, obj))
    return out + render_partners.rendered(spec, owner)


async def apply_through_gate(
    ctx: OperatorContext, spec: InferenceSpec, owner: render.Owner, state: ResourceState, target: rollout_gate.Target,
    apply_if_waiting: bool = True,
) -> rollout_gate.Gate:
    """``apply_children`` (with ``state``'s written fingerprints and replicas) through the rollout
    gate: an operator-caused pod-template change waits for a slot (``rollout_gate.release``;
    ``apply_if_waiting`` False: only ask the gate, apply nothing while the change waits)."""
    keyed, _ = await keyed_owner(ctx, spec, owner)
    leave = bool(state.foreign_autoscalers)
    gated = gated_objects(spec, rendered_children(spec, keyed, None, leave))
    cfg = ctx.config

    async def apply(hold: rollout_gate.Hold) -> None:
        await apply_children(ctx, spec, owner, state.written, state.replicas, leave, hold)

    try:
        gate = await rollout_gate.release(ctx.kube, cfg.lease_namespace, cfg.max_concurrent_rollouts,
                                          ctx.rollout_lock, target, gated, apply, apply_if_waiting)
    except KubeError as exc:
        raise SpecRejected(exc, exc.status in refusals.PERMANENT_CODES) from exc
    state.rollout = gate
    return gate


def gated_objects(spec: InferenceSpec, children: list[tuple[Kind, dict[str, Any], dict[str, Any]]]
                  ) -> list[rollout_gate.Gated]:
    """What the rollout gate covers among ``children``: the workload (Deployment or LWS) and the
    picker's Deployment."""
    out = []
    for kind, body, _ in children:
        name = body["metadata"]["name"]
        if kind in (DEPLOYMENTS, LEADER_WORKER_SETS) and name in (spec.name, picker_name(spec.name)):
            part = rollout_gate.gated_part(body)
            assert part is not None  # rendered: a workload always has its template
            out.append(rollout_gate.Gated(kind, name, part, picker=name != spec.name))
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
    desired = (cr_status or {}).get("desiredReplicas")
    if state.replicas is None and isinstance(desired, int) and not isinstance(desired, bool) and desired > 0:
        state.replicas = desired


def pool_children(name: str) -> list[tuple[Kind, str]]:
    """What ``inferencePool`` may create: the pool and the picker's Deployment, Service,
    ServiceAccount and RoleBinding."""
    return [(INFERENCE_POOLS, name), (DEPLOYMENTS, picker_name(name)), (SERVICES, picker_name(name)),
            (SERVICE_ACCOUNTS, picker_name(name)), (ROLE_BINDINGS, picker_name(name))]


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
    try:  # spec.nodes > 1; a cluster without the LWS kind answers 404 (nothing to delete)
        if await ctx.kube.delete(LEADER_WORKER_SETS, namespace, name):
            deleted.append(LEADER_WORKER_SETS.kind)
    except KubeError as exc:
        if exc.status != 403:  # an older chart's RBAC: it could not have created one either
            raise
    owners = ((await ctx.kube.get(PVCS, namespace, f"{name}-model-cache") or {}).get("metadata") or {}).get(
        "ownerReferences") or []
    if uid and any(o.get("uid") == uid for o in owners) and await ctx.kube.delete(PVCS, namespace, f"{name}-model-cache"):
        deleted.append(PVCS.kind)
    return deleted


def live_key(spec: InferenceSpec) -> str:
    return json.dumps(engine_args.live_values(spec.engine), sort_keys=True)


async def list_pods(ctx: OperatorContext, spec: InferenceSpec) -> list[dict[str, Any]]:
    """The pods that serve HTTP (a multi-node group's leaders only: the workers are headless)."""
    return await ctx.cache.list(PODS, spec.namespace, render.serving_labels(spec))


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
