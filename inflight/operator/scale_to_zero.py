"""Scale to zero and back (``autoscaling.minReplicas: 0``): the activator's demand, and the
decision it adds to the autoscaler's.

Owns ``Demand`` (what an activator answers: requests held and in flight, seconds idle),
``report`` (the operator's one POST per tick and scale-to-zero resource to one activator
replica: where the backend is and its replicas; the answer is its demand) and ``adjust`` (a pure
function on the autoscaler's ``Decision``): at 0 replicas, anything held or in flight means 1
(``ScaleFromZero``); at 1, nothing held or in flight for the scale-down window, and a measured
empty queue on the pods, means 0 (``ScaleToZero``), after every activator replica was told (so
it holds every later request) and still had nothing in flight. Without the demand (no activator
configured, or a replica that cannot be reached) a running service is never scaled to 0 and the
reason says why. ``activator_fleet`` asks every replica and sums; the activator's side is
``inflight.operator.activator``. Knows nothing about kopf.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

import aiohttp

from inflight.operator.autoscaler import Decision
from inflight.operator.spec import InferenceSpec


@dataclass(frozen=True, slots=True)
class Demand:
    held: int
    in_flight: int
    idle_seconds: float


def parse_demand(raw: Any) -> Demand | None:
    """The activator's answer as ``Demand``; None when it is not one."""
    if not isinstance(raw, dict):
        return None
    held, in_flight, idle = raw.get("held"), raw.get("inFlight"), raw.get("idleSeconds")
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (held, in_flight))
    if not ints or isinstance(idle, bool) or not isinstance(idle, (int, float)) or idle < 0:
        return None
    return Demand(held, in_flight, float(idle))  # type: ignore[arg-type]


async def report(http: aiohttp.ClientSession, activator_url: str, namespace: str, name: str, port: int,
                 replicas: int, timeout_s: float) -> tuple[Demand | None, str]:
    """POST the backend's port and replicas to the activator; (its demand, "") or (None, why not)."""
    url = f"{activator_url.rstrip('/')}/activator/backends/{namespace}/{name}"
    try:
        async with http.post(url, json={"port": port, "replicas": replicas},
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None, f"the activator answered {resp.status}"
            demand = parse_demand(await resp.json(content_type=None))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return None, f"the activator at {activator_url} cannot be reached ({type(exc).__name__}: {exc})"
    return (demand, "") if demand is not None else (None, "the activator's answer is not a demand")


def adjust(decision: Decision, current: int, demand: Demand | None, why_none: str, idle_window_s: float
           ) -> Decision:
    """The autoscaler's decision for a ``minReplicas: 0`` resource, with the activator's demand."""
    if demand is None:
        if current == 0 or decision.desired == 0:
            return dataclasses.replace(decision, desired=current, reason="ActivatorUnavailable",
                                       message=f"{why_none}; holding {current} replica(s)")
        return dataclasses.replace(decision, message=f"{decision.message}; not scaling to 0: {why_none}")
    waiting = demand.held + demand.in_flight
    if current == 0:
        if waiting:
            return dataclasses.replace(decision, desired=1, reason="ScaleFromZero",
                                       message=f"{demand.held} request(s) held and {demand.in_flight} in flight "
                                               "at the activator")
        return dataclasses.replace(decision, desired=0, reason="ScaledToZero", message="idle: nothing held")
    idle = (not waiting and demand.idle_seconds >= idle_window_s and decision.desired <= 1
            and decision.queue_depth is not None and decision.queue_depth == 0)
    if idle:
        return dataclasses.replace(decision, desired=0, reason="ScaleToZero",
                                   message=f"idle {demand.idle_seconds:.0f}s >= {idle_window_s:g}s with nothing "
                                           "held or in flight at the activator and an empty queue")
    return dataclasses.replace(decision, desired=max(1, decision.desired))


def parse_selector(text: str) -> dict[str, str]:
    """``k=v,k2=v2`` as labels; ValueError on anything else (only equality is supported)."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip() or "!" in key or "=" in value:
            raise ValueError(f"the activator pods' selector must be key=value pairs separated by commas "
                             f"(got {text!r}).")
        labels[key.strip()] = value.strip()
    if not labels:
        raise ValueError(f"the activator pods' selector names no label (got {text!r}).")
    return labels


def due_at_zero(spec: InferenceSpec, deployment: dict[str, Any]) -> bool:
    """Whether a round is due every tick: a ``minReplicas: 0`` resource at 0 replicas (a held
    request waits at most one tick for its scale-up, not an autoscaling interval)."""
    return spec.autoscaling.min_replicas == 0 and not int((deployment.get("spec") or {}).get("replicas") or 0)
