"""Live LoRA adapters: each tick, every pod whose runtime is ready gets exactly ``spec.adapters``.

Owns the per-pod loop: read ``GET /v1/models`` (adapters are the entries whose ``parent`` is the
served model; ``root`` is their path), load the missing ones through ``POST
/v1/load_lora_adapter`` and unload the removed ones through ``POST /v1/unload_lora_adapter``
with the pod's admin key (the key live config is pushed with), then the pod's readiness gate
``inflight.dev/adapters-loaded`` (``render_adapters``): True once every adapter was either
loaded or refused by the runtime (a 400: its files are bad, and would be on any pod), so a bad
adapter does not keep new pods out of the Service; False while one is still missing for another
reason, and reset when the runtime container restarted (its restart count is kept in the gate's
message) or stopped being ready, so a restarted runtime gets its adapters again before it is
Ready. Also owns ``status.adapters`` (loaded on N of M pods, last error), the ``AdaptersReady``
condition and the ``AdapterLoadFailed`` Events. The pure part (``plan``, ``summarize``) is
tested by table; HTTP goes through ``adapter_client``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from inflight.operator import adapter_client, metrics_scrape, status
from inflight.operator.adapter_source import adapter_path
from inflight.operator.context import OperatorContext
from inflight.operator.kube import PODS, KubeError
from inflight.operator.render_adapters import READINESS_GATE
from inflight.operator.spec import InferenceSpec, lora_enabled

logger = logging.getLogger(__name__)

RETRY_REFUSED_S = 60.0  # an adapter a pod refused is tried on it again after this (files fixed in place)
GATE_REASON = "AdaptersLoaded"


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do on one pod: unload first (a changed path is an unload and a load), then load."""

    unload: tuple[str, ...]
    load: tuple[tuple[str, str], ...]  # (name, path)


def plan(wanted: dict[str, str], loaded: dict[str, str]) -> Plan:
    """``wanted``/``loaded``: adapter name -> path. Unknown extras are unloaded (the operator owns
    the pods' adapter set), a path change reloads, order follows the names."""
    unload = tuple(sorted(n for n, p in loaded.items() if wanted.get(n) != p))
    load = tuple(sorted((n, p) for n, p in wanted.items() if loaded.get(n) != p))
    return Plan(unload=unload, load=load)


@dataclass(slots=True)
class AdapterState:
    """What the operator remembers between ticks (in memory; the pods are the truth)."""

    refused: dict[tuple[str, str, str], tuple[float, str]] = field(default_factory=dict)  # (pod, name, path)
    last_error: dict[str, str] = field(default_factory=dict)  # adapter name -> last load error
    posted: set[tuple[str, str]] = field(default_factory=set)  # (name, error) Events already posted


@dataclass(frozen=True, slots=True)
class PodResult:
    pod: str
    loaded: frozenset[str]  # adapters (of spec.adapters) loaded on the pod after this tick
    refused: dict[str, str]  # adapter -> the runtime's reason (a 400)
    error: str | None  # the pod could not be read or a call failed for another reason


def wanted_paths(spec: InferenceSpec) -> dict[str, str]:
    return {a.name: adapter_path(a, spec.model) for a in spec.adapters}


def runtime_ready(pod: dict[str, Any]) -> bool:
    """The runtime container passes its readiness probe (the pod itself may wait on the gate)."""
    st = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or st.get("phase") != "Running":
        return False
    return any(c.get("type") == "ContainersReady" and c.get("status") == "True" for c in st.get("conditions") or [])


def has_gate(pod: dict[str, Any]) -> bool:
    return any(g.get("conditionType") == READINESS_GATE for g in (pod.get("spec") or {}).get("readinessGates") or [])


def restart_count(pod: dict[str, Any]) -> int:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == "runtime":
            return int(cs.get("restartCount") or 0)
    return 0


def gate_condition(pod: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == READINESS_GATE),
                None)


def gate_message(restarts: int, loaded: int, total: int) -> str:
    return f"restartCount={restarts}: {loaded}/{total} adapters loaded"


def gate_is_current(pod: dict[str, Any]) -> bool:
    """The gate is True and was set for the runtime container as it runs now."""
    cond = gate_condition(pod)
    if cond is None or cond.get("status") != "True":
        return False
    return str(cond.get("message", "")).startswith(f"restartCount={restart_count(pod)}:")


def summarize(spec: InferenceSpec, results: list[PodResult], last_error: dict[str, str]
              ) -> tuple[list[dict[str, Any]], status.Condition]:
    """``status.adapters`` and the ``AdaptersReady`` condition from this tick's pod results."""
    total = len(results)
    rows = []
    for adapter in spec.adapters:
        row: dict[str, Any] = {"name": adapter.name, "totalPods": total,
                               "loadedPods": sum(adapter.name in r.loaded for r in results)}
        if adapter.name in last_error:
            row["lastError"] = last_error[adapter.name]
        rows.append(row)
    refused = sorted({(n, why) for r in results for n, why in r.refused.items()})
    failing = [r for r in results if r.error]
    missing = [row["name"] for row in rows if row["loadedPods"] < total]
    if refused:
        name, why = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        cond = status.Condition("AdaptersReady", False, "LoadFailed",
                                f"adapter {name} was refused: {why}{more}; the other adapters stay loaded")
    elif failing:
        cond = status.Condition("AdaptersReady", False, "PodUnreachable",
                                f"{len(failing)} pod(s) not synced, e.g. {failing[0].error}")
    elif missing:
        cond = status.Condition("AdaptersReady", False, "Loading", f"not yet on every pod: {', '.join(missing)}")
    elif total == 0:
        cond = status.Condition("AdaptersReady", False, "NoPods", "no pod's runtime is ready")
    else:
        cond = status.Condition("AdaptersReady", True, "AllLoaded",
                                f"{len(spec.adapters)} adapter(s) loaded on {total} pod(s)")
    return rows, cond


async def _sync_pod(session: aiohttp.ClientSession, target: metrics_scrape.PodTarget, wanted: dict[str, str],
                    key: str, timeout_s: float, memory: AdapterState, now: float) -> PodResult:
    try:
        loaded = await adapter_client.list_adapters(session, target, key, timeout_s)
        todo = plan(wanted, loaded)
        for name in todo.unload:
            await adapter_client.unload(session, target, name, key, timeout_s)
            loaded.pop(name, None)
        refused: dict[str, str] = {}
        for name, path in todo.load:
            held = memory.refused.get((target.name, name, path))
            if held is not None and now - held[0] < RETRY_REFUSED_S:
                refused[name] = held[1]
                continue
            why = await adapter_client.load(session, target, name, path, key, timeout_s)
            if why is None:
                loaded[name] = path
                memory.refused.pop((target.name, name, path), None)
            else:
                refused[name] = why
                memory.refused[(target.name, name, path)] = (now, why)
    except adapter_client.PodCallError as exc:
        return PodResult(target.name, frozenset(), {}, str(exc))
    return PodResult(target.name, frozenset(n for n in wanted if loaded.get(n) == wanted[n]), refused, None)


async def _set_gate(ctx: OperatorContext, pod: dict[str, Any], ready: bool, message: str) -> None:
    """Merge-patch the pod's conditions with the gate's (the list is replaced whole: the others
    are sent back as read; the kubelet re-asserts its own on its next status sync)."""
    conditions = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != READINESS_GATE]
    conditions.append({"type": READINESS_GATE, "status": "True" if ready else "False", "reason": GATE_REASON
                       if ready else "AdaptersPending", "message": message,
                       "lastTransitionTime": status.rfc3339(time.time())})
    meta = pod["metadata"]
    await ctx.kube.patch(PODS, meta["namespace"], meta["name"], {"status": {"conditions": conditions}}, "status")


async def sync(ctx: OperatorContext, spec: InferenceSpec, memory: AdapterState, pods: list[dict[str, Any]],
               cr: dict[str, Any]) -> tuple[list[dict[str, Any]], status.Condition] | None:
    """One round over the pods (see the module docstring); ``None`` when LoRA is off."""
    if not lora_enabled(spec):
        return None
    wanted = wanted_paths(spec)
    results: list[PodResult] = []
    now = time.monotonic()
    for pod in pods:
        if not has_gate(pod):
            continue  # a pod of the template before LoRA was on (a roll under way): its runtime has no LoRA
        if not runtime_ready(pod):
            if (gate := gate_condition(pod)) is not None and gate.get("status") == "True" and not pod.get(
                    "metadata", {}).get("deletionTimestamp"):
                await _gate(ctx, pod, False, "the runtime is not ready: adapters are loaded again when it is")
            continue
        target = metrics_scrape.pod_target(pod)
        if target is None:
            continue
        key, _ = await ctx.admin_key(spec.namespace, spec.name)
        result = await _sync_pod(ctx.http, target, wanted, key, ctx.config.pod_timeout_seconds, memory, now)
        results.append(result)
        done = result.error is None and set(result.loaded) | set(result.refused) >= set(wanted)
        message = gate_message(restart_count(pod), len(result.loaded), len(wanted))
        gate = gate_condition(pod)
        if done and not gate_is_current(pod):
            await _gate(ctx, pod, True, message)
        elif not done and (gate is None or gate.get("status") == "True"):
            await _gate(ctx, pod, False, message)
    for result in results:
        for name, why in result.refused.items():
            memory.last_error[name] = why
            await _post_once(ctx, cr, memory, name, f"pod {result.pod}: {why}")
        for name in result.loaded:
            if not any(name in r.refused for r in results):
                memory.last_error.pop(name, None)
    for gone in set(memory.last_error) - set(wanted):
        del memory.last_error[gone]
    return summarize(spec, results, memory.last_error)


async def _gate(ctx: OperatorContext, pod: dict[str, Any], ready: bool, message: str) -> None:
    try:
        await _set_gate(ctx, pod, ready, message)
    except KubeError as exc:  # the next tick tries again
        logger.warning("could not set %s on pod %s: %s", READINESS_GATE, pod["metadata"].get("name"), exc)


async def _post_once(ctx: OperatorContext, cr: dict[str, Any], memory: AdapterState, name: str, why: str) -> None:
    key = (name, why.partition(": ")[2])
    if key in memory.posted:
        return
    try:
        await ctx.kube.post_event(cr, "Warning", "AdapterLoadFailed", f"adapter {name}: {why}")
    except KubeError as exc:
        logger.warning("could not post the AdapterLoadFailed Event yet: %s", exc)
        return
    if len(memory.posted) >= 256:
        memory.posted.clear()
    memory.posted.add(key)
