"""Leader election over a ``coordination.k8s.io/v1`` Lease, so two operator replicas never both
act: one holds the Lease and runs, the other waits (serving its liveness endpoint) and takes
over when the holder stops renewing.

Owns the Lease protocol as client-go's leader election has it: a candidate takes the Lease
when it is free or when its record (holder and renew time) has not changed for
``leaseDurationSeconds`` of the candidate's *own* clock (so clock skew between nodes does not
matter), writes with the ``resourceVersion`` it read (the API server refuses a stale write
with 409, so two candidates never both win), and renews every ``renew_every_s``.

Why leadership can never overlap: a round that starts at ``t`` (before its first request) and
succeeds makes this replica the leader until ``t + renew_deadline_s`` (client-go's
RenewDeadline, two thirds of the lease by default). Any other candidate first sees the record
that round wrote at some ``t' >= t`` and may take it only at ``t' + duration_s``, strictly later.
Every round runs under a timeout that ends at that validity bound, so a renewal that hangs (a
stalled API server, a partition that swallows the request) is abandoned in time, and
``on_lost`` is called the moment the bound passes without a confirmed renewal (the operator
process then exits and its restart waits as a candidate again). ``holds()`` tells code about
to act whether it still may: False from that bound on, whatever the event loop is doing.
A clean shutdown releases the Lease so the standby takes over at once. kopf's own peering is
not used: it lets equal-priority operators both run.
Knows nothing about InferenceDeployments.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp.web

from inflight.operator.kube import LEASES, KubeClient, KubeError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LeaseConfig:
    name: str
    namespace: str
    identity: str  # the pod's name: unique among the replicas
    duration_s: float = 15.0  # a record unchanged this long (own clock) is free to take
    renew_every_s: float = 5.0
    retry_every_s: float = 2.0
    # How long a confirmed round keeps this replica the leader (client-go's RenewDeadline);
    # 0 = two thirds of ``duration_s``. Must be < ``duration_s``: the gap covers the time a
    # round's record takes to reach the other candidates and the stop of this replica's work.
    renew_deadline_s: float = 0.0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.renew_every_s <= 0 or self.retry_every_s <= 0:
            raise ValueError("LeaseConfig: duration_s, renew_every_s and retry_every_s must be > 0.")
        if self.renew_deadline_s < 0 or self.renew_deadline_s >= self.duration_s:
            raise ValueError(f"LeaseConfig.renew_deadline_s must be in [0, duration_s) "
                             f"(got {self.renew_deadline_s} with duration_s {self.duration_s}).")
        if self.renew_every_s >= self.deadline_s:
            raise ValueError(f"LeaseConfig.renew_every_s ({self.renew_every_s}) must be shorter than the "
                             f"renew deadline ({self.deadline_s}), or the lease lapses between renewals.")

    @property
    def deadline_s(self) -> float:
        """How long after a round starts its success keeps this replica the leader."""
        return self.renew_deadline_s or self.duration_s * 2 / 3


def micro_time(ts: float) -> str:
    """A Kubernetes MicroTime (RFC 3339 with microseconds)."""
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, kube: Callable[[], KubeClient], config: LeaseConfig,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._kube = kube  # the current client (a re-login replaces it)
        self.config = config
        self._clock = clock
        self._wall = wall
        self._observed: tuple[Any, Any] | None = None  # (holder, renewTime) last read
        self._observed_at = 0.0
        self.is_leader = False
        self._valid_until = 0.0  # own clock: leadership lapses here without a confirmed round

    def holds(self) -> bool:
        """Whether this replica may act now: it leads and its last confirmed round is recent
        enough that no other candidate can have taken the Lease."""
        return self.is_leader and self._clock() < self._valid_until

    @property
    def valid_until(self) -> float:
        return self._valid_until

    async def try_acquire_or_renew(self, timeout_s: float | None = None) -> bool:
        """One round: True when this candidate holds the Lease afterwards. A round that does not
        finish within ``timeout_s`` (default: the renew deadline) raises ``TimeoutError``."""
        started = self._clock()
        timeout = self.config.deadline_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise TimeoutError("no time left for a lease round")
        won = await asyncio.wait_for(self._round(), timeout)
        if won:
            self._valid_until = started + self.config.deadline_s
        return won

    async def _round(self) -> bool:
        cfg = self.config
        lease = await self._kube().get(LEASES, cfg.namespace, cfg.name)
        now = self._wall()
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                    "spec": self._spec(now, acquired=True, transitions=0)}
            try:
                await self._kube().create(LEASES, cfg.namespace, body)
            except KubeError as exc:
                if exc.status == 409:  # another candidate created it first
                    return self._lost()
                raise
            return self._won()
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        record = (holder, spec.get("renewTime"))
        if record != self._observed:
            self._observed, self._observed_at = record, self._clock()
        duration = float(spec.get("leaseDurationSeconds") or cfg.duration_s)
        expired = self._clock() - self._observed_at >= duration
        if holder and holder != cfg.identity and not expired:
            return self._lost()
        ours = holder == cfg.identity
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if ours else 1)
        patch = {"metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")},
                 "spec": self._spec(now, acquired=not ours, transitions=transitions)}
        try:
            await self._kube().patch(LEASES, cfg.namespace, cfg.name, patch)
        except KubeError as exc:
            if exc.status == 409:  # changed since we read it: someone else renewed or took it
                return self._lost()
            raise
        if not ours:
            logger.info("took the lease %s/%s from %s", cfg.namespace, cfg.name, holder or "nobody")
        return self._won()

    def _spec(self, now: float, acquired: bool, transitions: int) -> dict[str, Any]:
        spec: dict[str, Any] = {"holderIdentity": self.config.identity,
                                "leaseDurationSeconds": max(1, round(self.config.duration_s)),
                                "renewTime": micro_time(now), "leaseTransitions": transitions}
        if acquired:
            spec["acquireTime"] = micro_time(now)
        return spec

    def _won(self) -> bool:
        self.is_leader = True
        return True

    def _lost(self) -> bool:
        self.is_leader = False
        return False

    async def acquire(self) -> None:
        """Wait until this candidate holds the Lease (API errors are retried)."""
        logged = False
        while True:
            try:
                if await self.try_acquire_or_renew():
                    logger.info("leading: holding lease %s/%s as %s",
                                self.config.namespace, self.config.name, self.config.identity)
                    return
            except (KubeError, TimeoutError) as exc:
                logger.warning("lease %s/%s: %s", self.config.namespace, self.config.name, exc)
            if not logged:
                logger.info("standing by: lease %s/%s is held by %s", self.config.namespace,
                            self.config.name, (self._observed or ("?",))[0])
                logged = True
            await asyncio.sleep(self.config.retry_every_s)

    async def keep(self, on_lost: Callable[[], None]) -> None:
        """Renew until cancelled; call ``on_lost`` once, the moment leadership cannot be
        confirmed: the Lease was taken by another candidate, or no round succeeded before the
        validity bound of the last one (a round still hanging then is abandoned)."""
        cfg = self.config
        wait = cfg.renew_every_s
        while True:
            await asyncio.sleep(max(0.0, min(wait, self._valid_until - self._clock())))
            try:
                if await self.try_acquire_or_renew(timeout_s=self._valid_until - self._clock()):
                    wait = cfg.renew_every_s
                    continue
                logger.error("lost the lease %s/%s to %s", cfg.namespace, cfg.name,
                             (self._observed or ("?",))[0])
            except (KubeError, TimeoutError) as exc:
                if self.holds():  # a failed round with time left: retry soon
                    logger.warning("renewing lease %s/%s: %s", cfg.namespace, cfg.name, exc or "timed out")
                    wait = cfg.retry_every_s
                    continue
                logger.error("could not confirm the lease %s/%s within %.1f s of the last renewal: "
                             "stopping before another candidate may take it", cfg.namespace, cfg.name,
                             cfg.deadline_s)
            self.is_leader = False
            on_lost()
            return

    async def release(self) -> None:
        """Give the Lease up (clean shutdown) so a standby need not wait for it to expire."""
        if not self.is_leader:
            return
        self.is_leader = False
        with contextlib.suppress(KubeError, TimeoutError):
            await asyncio.wait_for(self._release(), self.config.deadline_s)

    async def _release(self) -> None:
        lease = await self._kube().get(LEASES, self.config.namespace, self.config.name)
        if lease and (lease.get("spec") or {}).get("holderIdentity") == self.config.identity:
            await self._kube().patch(LEASES, self.config.namespace, self.config.name, {
                "metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")},
                "spec": {"holderIdentity": None, "leaseDurationSeconds": 1}})


@contextlib.asynccontextmanager
async def standby_health(port: int | None, host: str = "0.0.0.0"):  # noqa: ANN201
    """While standing by, answer the liveness probe on kopf's port (kopf serves it only once
    it runs); closed before kopf binds the port."""
    if not port:
        yield
        return

    async def healthz(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"standby": True})

    app = aiohttp.web.Application()
    app.router.add_get("/healthz", healthz)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, host, port)
    await site.start()
    try:
        yield
    finally:
        await runner.cleanup()
