"""The rollout gate: pod-template changes the operator itself causes roll a few models at a time.

A new operator version, a new default runtime image (the chart's ``runtimeImage``) or a new
root key changes the pod template of every InferenceDeployment at once, with no edit of any
CR. The gated objects of a model are its workload (the Deployment's ``spec.template``, or a
multi-node model's LeaderWorkerSet's ``spec.leaderWorkerTemplate``: ``gated_part``) and its
endpoint picker's Deployment (``inferencePool``: a new default picker image rolls it); one
model takes one slot for all of them. Such a change is told apart from a user's edit by the CR generation that rendered the
Deployment's current template (the annotation ``inflight.dev/spec-generation`` on the
Deployment): the template the operator renders now differs from the one it recorded
(``applied``'s last-applied record) while the generation is the same (or was never recorded: a
Deployment an older operator wrote). A user's edit (a new generation) is never gated.

A gated change waits while ``maxConcurrentRollouts`` (``OperatorConfig.max_concurrent_rollouts``)
operator-caused rollouts are in progress; the Deployment keeps its recorded template meanwhile
(``Hold``). In progress means: listed in the ledger, the ConfigMap ``inflight-operator-rollouts``
in the operator's own namespace (one key ``<namespace>.<name>`` per released rollout, with the
generation of each object it rolls after the release), and one of those not rolled out yet
(``rolled_out``: a Deployment as ``kubectl rollout status`` reads it; an LWS when its groups
are ready at the new generation, ``lws_status.rolled_out``). The ledger and the held templates live
in the cluster, so a restarted operator counts the same rollouts. With ``manual`` every gated
change waits for the annotation ``inflight.dev/rollout: approved`` on the CR, which also starts
a waiting rollout at once under a limit; the operator removes it when it used it.

Pure functions apart from ``admit``/``record``/``release``; knows nothing about kopf.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from inflight.operator import applied, lws_status
from inflight.operator.kube import CONFIGMAPS, DEPLOYMENTS, LEADER_WORKER_SETS, Kind, KubeClient
from inflight.operator.status import Condition

GENERATION_ANNOTATION = "inflight.dev/spec-generation"
APPROVAL_ANNOTATION = "inflight.dev/rollout"
APPROVED = "approved"
LEDGER_NAME = "inflight-operator-rollouts"
MANUAL = "manual"
UNLIMITED = "unlimited"
MAX_NAMED = 5  # rolling models named in a condition message
GATED_KINDS = {k.kind: k for k in (DEPLOYMENTS, LEADER_WORKER_SETS)}


def parse_limit(raw: object) -> int | str:
    """``maxConcurrentRollouts``: an integer >= 1, ``manual`` or ``unlimited`` (``ValueError`` else)."""
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 1:
        return raw
    text = str(raw).strip().lower()
    if text in (MANUAL, UNLIMITED):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"maxConcurrentRollouts (INFLIGHT_OPERATOR_MAX_CONCURRENT_ROLLOUTS) must be an integer >= 1, "
                     f"'{MANUAL}' or '{UNLIMITED}' (got {raw!r}).")


@dataclass(frozen=True, slots=True)
class Hold:
    """How to render the gated objects: ``generation`` goes on each (``GENERATION_ANNOTATION``);
    ``template`` (the workload's) and ``picker`` (the picker Deployment's), when set, are the
    recorded templates (``gated_part``) kept while a gated change waits."""

    generation: int | None = None
    template: dict[str, Any] | None = None
    picker: dict[str, Any] | None = None

    def for_picker(self) -> Hold:
        """The hold to render the picker's Deployment with."""
        return Hold(self.generation, self.picker)


@dataclass(frozen=True, slots=True)
class Gated:
    """One object the gate covers: its kind, name and the gated part rendered now."""

    kind: Kind
    name: str
    rendered: dict[str, Any]
    picker: bool = False


def gated_part(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    """What an operator-caused change of ``obj`` rolls: a Deployment's ``spec.template``, an LWS's
    ``spec.leaderWorkerTemplate`` (both pod templates and the group's shape)."""
    spec = (obj or {}).get("spec") or {}
    part = spec.get("leaderWorkerTemplate") if "leaderWorkerTemplate" in spec else spec.get("template")
    return part if isinstance(part, dict) else None


@dataclass(frozen=True, slots=True)
class Gate:
    """The gate's answer for one model: ``waiting`` (with the condition's reason and message),
    and whether the CR's approval annotation was used (the caller removes it)."""

    waiting: bool = False
    reason: str = ""
    message: str = ""
    approval_used: bool = False


def held_template(live: dict[str, Any] | None, rendered_template: dict[str, Any], generation: int | None
                  ) -> dict[str, Any] | None:
    """The template ``live`` was last given by the operator, when the one rendered now differs
    from it for a reason of the operator's own (the same CR generation, or none recorded);
    ``None`` when there is nothing to gate (no Deployment, no record, same template, a user's edit)."""
    if live is None or generation is None:
        return None
    old = gated_part(applied.last_applied(live))
    if old is None:
        return None
    if old == json.loads(json.dumps(applied.without_nulls(rendered_template))):
        return None
    seen = ((live.get("metadata") or {}).get("annotations") or {}).get(GENERATION_ANNOTATION)
    if seen is not None and seen != str(generation):
        return None  # rendered from another generation of the spec: the user's edit rolls now
    return old


def with_hold(deployment: dict[str, Any], hold: Hold | None) -> dict[str, Any]:
    """``deployment`` (a Deployment or LWS, or its patch) with the generation annotation and the
    held template (``gated_part``)."""
    if hold is None or (hold.generation is None and hold.template is None):
        return deployment
    out = copy.deepcopy(deployment)
    if hold.generation is not None:
        out.setdefault("metadata", {}).setdefault("annotations", {})[GENERATION_ANNOTATION] = str(hold.generation)
    if hold.template is not None:
        key = "leaderWorkerTemplate" if "leaderWorkerTemplate" in out["spec"] else "template"
        out["spec"][key] = copy.deepcopy(hold.template)
    return out


def rolled_out(deployment: dict[str, Any], since_generation: int) -> bool:
    """Whether ``deployment`` finished rolling out its generation ``since_generation`` (or a later
    one) and is available, as ``kubectl rollout status`` decides it."""
    st = deployment.get("status") or {}
    if int(st.get("observedGeneration") or 0) < since_generation:
        return False
    want = (deployment.get("spec") or {}).get("replicas")
    want = 1 if want is None else int(want)
    updated = int(st.get("updatedReplicas") or 0)
    return updated >= want and int(st.get("replicas") or 0) <= updated and int(st.get("availableReplicas") or 0) >= updated


def object_rolled_out(kind: Kind, live: dict[str, Any], since_generation: int) -> bool:
    """``rolled_out`` for a Deployment, ``lws_status.rolled_out`` for a LeaderWorkerSet."""
    if kind == LEADER_WORKER_SETS:
        return lws_status.rolled_out(live, since_generation)
    return rolled_out(live, since_generation)


def pending_condition(gate: Gate | None) -> Condition:
    """``RolloutPending``: True while an operator-caused template change waits at the gate."""
    if gate is None or not gate.waiting:
        return Condition("RolloutPending", False, "NoPendingRollout", "the workload (and the endpoint picker) "
                         "have the operator's current pod template")
    return Condition("RolloutPending", True, gate.reason, gate.message)


def approved(body: Any) -> bool:
    return ((body.get("metadata") or {}).get("annotations") or {}).get(APPROVAL_ANNOTATION) == APPROVED


def waiting_gate(limit: int | str, rolling: list[str]) -> Gate:
    """The waiting answer for ``limit`` (``rolling``: the models holding the slots)."""
    how = (f"annotate the InferenceDeployment {APPROVAL_ANNOTATION}={APPROVED} to start it now")
    if limit == MANUAL:
        return Gate(True, "AwaitingApproval", "the operator's pod template changed (a new operator version, runtime "
                    f"or picker image default, or root key) and maxConcurrentRollouts is manual: {how}")
    named = ", ".join(rolling[:MAX_NAMED]) + (f" and {len(rolling) - MAX_NAMED} more" if len(rolling) > MAX_NAMED
                                              else "")
    return Gate(True, "WaitingForRolloutSlot", f"the operator's pod template changed (a new operator version, "
                f"runtime or picker image default, or root key): it rolls when one of the {len(rolling)} operator rollouts in "
                f"progress (maxConcurrentRollouts {limit}: {named}) is rolled out and available, or {how}")


def _key(namespace: str, name: str) -> str:
    return f"{namespace}.{name}"  # a namespace has no dot: the first one splits the key


async def admit(kube: KubeClient, own_namespace: str, limit: int | str, namespace: str, name: str,
                is_approved: bool) -> Gate:
    """Whether the gated change of ``namespace/name`` may roll now (``Gate.waiting`` False);
    drops finished rollouts from the ledger on the way."""
    if is_approved:
        return Gate(approval_used=True)
    if limit == UNLIMITED:
        return Gate()
    if limit == MANUAL:
        return waiting_gate(limit, [])
    ledger = await kube.get(CONFIGMAPS, own_namespace, LEDGER_NAME)
    rolling, done = [], []
    for key, text in sorted(((ledger or {}).get("data") or {}).items()):
        if key == _key(namespace, name):
            continue  # its own earlier rollout: this one replaces it
        ns, _, other = key.partition(".")
        try:
            objects = _ledger_objects(other, json.loads(text))
        except (ValueError, KeyError, TypeError, AttributeError):
            done.append(key)
            continue
        for kind, obj_name, since in objects:
            live = await kube.get(kind, ns, obj_name)
            if live is not None and not object_rolled_out(kind, live, since):
                rolling.append(key)
                break
        else:
            done.append(key)
    if done:
        await kube.patch(CONFIGMAPS, own_namespace, LEDGER_NAME, {"data": dict.fromkeys(done)})
    if isinstance(limit, int) and len(rolling) >= limit:
        return waiting_gate(limit, [k.replace(".", "/", 1) for k in rolling])
    return Gate()


def _ledger_objects(name: str, entry: dict[str, Any]) -> list[tuple[Kind, str, int]]:
    """(kind, name, generation) of each object a ledger entry rolls (an entry without
    ``objects``, an older operator's, is the Deployment ``name``)."""
    if "objects" not in entry:
        return [(DEPLOYMENTS, name, int(entry["generation"]))]
    return [(GATED_KINDS[o["kind"]], str(o["name"]), int(o["generation"])) for o in entry["objects"]]


async def record(kube: KubeClient, own_namespace: str, namespace: str, name: str, generation: int,
                 objects: list[tuple[Kind, str, int]] | None = None) -> None:
    """Note in the ledger that ``namespace/name`` rolls from its Deployment generation ``generation``,
    or (``objects``) each of those objects from its generation."""
    entry: dict[str, Any] = {"generation": generation}
    if objects is not None:
        entry["objects"] = [{"kind": k.kind, "name": n, "generation": g} for k, n, g in objects]
    data = {_key(namespace, name): json.dumps(entry)}
    body = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": LEDGER_NAME, "namespace": own_namespace,
                         "labels": {"app.kubernetes.io/managed-by": "inflight-operator"}},
            "data": data}
    if not await kube.create_if_missing(CONFIGMAPS, own_namespace, body):
        await kube.patch(CONFIGMAPS, own_namespace, LEDGER_NAME, {"data": data})


@dataclass(frozen=True, slots=True)
class Target:
    """One model at the gate: where it is, its CR generation and whether the CR approves."""

    namespace: str
    name: str
    generation: int | None
    is_approved: bool = False


async def release(
    kube: KubeClient, own_namespace: str, limit: int | str, lock: contextlib.AbstractAsyncContextManager[Any],
    target: Target, gated: list[Gated], apply: Callable[[Hold], Awaitable[None]],
    apply_if_waiting: bool = True,
) -> Gate:
    """Apply the model's children through the gate: ``apply`` is called with the ``Hold`` to
    render with (the recorded templates while the change waits; not at all then unless
    ``apply_if_waiting``: a waiting model's retry changes nothing). ``gated``: the workload and
    the picker's Deployment as rendered now; one slot covers every one of them that changed.
    Admission, the apply and the ledger entry happen under ``lock``, so two models never take
    the last slot together."""
    held: dict[int, dict[str, Any]] = {}
    for i, obj in enumerate(gated):
        live = await kube.get(obj.kind, target.namespace, obj.name)
        if (old := held_template(live, obj.rendered, target.generation)) is not None:
            held[i] = old
    if not held:
        await apply(Hold(target.generation))
        return Gate()
    async with lock:
        gate = await admit(kube, own_namespace, limit, target.namespace, target.name, target.is_approved)
        if not gate.waiting:
            await apply(Hold(target.generation))
            if isinstance(limit, int):
                objects = []
                for i in sorted(held):
                    stored = await kube.get(gated[i].kind, target.namespace, gated[i].name)
                    objects.append((gated[i].kind, gated[i].name,
                                    int(((stored or {}).get("metadata") or {}).get("generation") or 0)))
                await record(kube, own_namespace, target.namespace, target.name, objects[0][2], objects)
            return gate
    if apply_if_waiting:  # the rest of the children, the templates held (outside the lock: it takes no slot)
        workload = next((held[i] for i in held if not gated[i].picker), None)
        picker = next((held[i] for i in held if gated[i].picker), None)
        await apply(Hold(target.generation, workload, picker))
    return gate
