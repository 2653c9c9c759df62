"""Every activator replica's demand, summed (the chart's ``activator.replicas`` > 1).

Owns where the activators are (``endpoints``: the pods matching ``OperatorConfig.activator_pods``
in the operator's own namespace, each at its pod IP and container port ``http``; else the one
``activator_url``) and ``report`` (the operator's report to each of them, their answers summed
into a ``FleetDemand``) and ``with_demand`` (the autoscaler's decision for a ``minReplicas: 0``
resource with that demand, and the two-step scale to 0: every replica is told 0 replicas
first, and the scale goes on only if all of them answered with nothing held or in flight). Each replica holds its own queue, so one answer through the Service
(whichever pod it picked) is not the demand. A replica that does not answer makes the sum
partial (``FleetDemand.unknown`` says which and why): the caller never scales to 0 on a partial
sum, while requests held at the replicas that did answer still scale 0 -> 1 (``usable``). A pod
with no IP yet (Pending) is left out: the Service sends it nothing. Knows nothing about kopf or
the autoscaler.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

from inflight.operator import kube, metrics_scrape, scale_to_zero
from inflight.operator.autoscaler import Decision
from inflight.operator.context import OperatorContext
from inflight.operator.scale_to_zero import Demand
from inflight.operator.spec import InferenceSpec


@dataclass(frozen=True, slots=True)
class FleetDemand:
    known: Demand  # summed over the replicas that answered (idle: the least idle one's)
    answered: int
    unknown: tuple[str, ...]  # why each other replica's demand is unknown

    @property
    def complete(self) -> bool:
        """Every replica answered (and there was at least one)."""
        return self.answered > 0 and not self.unknown

    def usable(self, current: int) -> tuple[Demand | None, str]:
        """The demand to decide on, or (None, why not): the full sum when every replica answered;
        at 0 replicas, a partial sum that holds requests (enough to scale up); else unknown."""
        waiting = self.known.held + self.known.in_flight
        if self.complete or (current == 0 and waiting):
            return self.known, ""
        return None, "; ".join(self.unknown) or "no activator replica answered"


def total(answers: list[tuple[Demand | None, str]], unknown: list[str]) -> FleetDemand:
    """The sum of the answers (``(demand, "")`` or ``(None, why)``) and the replicas already
    known to be unknown."""
    known = [d for d, _ in answers if d is not None]
    why = [*unknown, *(w for d, w in answers if d is None)]
    summed = Demand(held=sum(d.held for d in known), in_flight=sum(d.in_flight for d in known),
                    idle_seconds=min((d.idle_seconds for d in known), default=0.0))
    return FleetDemand(summed, len(known), tuple(why))


async def endpoints(ctx: OperatorContext) -> tuple[list[str], list[str]]:
    """(base URLs of the activator replicas, why some are unknown)."""
    config = ctx.config
    if not config.activator_pods:
        return [config.activator_url], []
    labels = scale_to_zero.parse_selector(config.activator_pods)
    try:
        pods = await ctx.kube.list(kube.PODS, config.lease_namespace, labels)
    except kube.KubeError as exc:
        return [], [f"the activator pods cannot be listed ({exc})"]
    urls = []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        if (target := metrics_scrape.pod_target(pod)) is not None:
            urls.append(target.base_url)
    if not urls:
        return [], [f"no activator pod is running in {config.lease_namespace} ({config.activator_pods})"]
    return urls, []


async def report(ctx: OperatorContext, spec: InferenceSpec, replicas: int) -> FleetDemand:
    """Tell every activator replica the backend's port and replicas; their demands summed."""
    urls, unknown = await endpoints(ctx)
    answers = await asyncio.gather(*(
        scale_to_zero.report(ctx.http, url, spec.namespace, spec.name, spec.service.port, replicas,
                             ctx.config.pod_timeout_seconds)
        for url in urls))
    return total(list(answers), unknown)


async def with_demand(ctx: OperatorContext, spec: InferenceSpec, decision: Decision, current: int) -> Decision:
    """``scale_to_zero.adjust`` with the demand every activator replica reports for ``spec``."""
    if not ctx.config.activator_url and not ctx.config.activator_pods:
        demand, why = None, "no activator is configured (the chart's activator.enabled)"
    else:
        demand, why = (await report(ctx, spec, current)).usable(current)
    adjusted = scale_to_zero.adjust(decision, current, demand, why, spec.autoscaling.scale_down_stabilization_seconds)
    if adjusted.desired == 0 and current > 0:
        # Tell every replica first (each holds every request from here on), and go on only if all
        # of them answered and nothing arrived since the demand was read; else undo and hold.
        after = await report(ctx, spec, 0)
        if not after.complete or after.known.held or after.known.in_flight:
            await report(ctx, spec, current)
            why = "; ".join(after.unknown) or f"{after.known.held} held, {after.known.in_flight} in flight"
            return dataclasses.replace(decision, desired=current, reason="ScaleToZeroCancelled",
                                       message=f"a request arrived or an activator replica did not answer while "
                                               f"scaling to 0 ({why}); holding")
    return adjusted
