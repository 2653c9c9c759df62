"""Test helper: an emulated API server that can hold a replica's Lease writes without ever
answering (a stalled API server or a partition that swallows requests), and that records, by
replica, every write it receives (the record the two-leader window is measured on).

Each operator replica logs in with a token of its own (``Bearer <identity>``), so the server
tells the replicas' requests apart, kopf's own status patches included. ``acts`` is the API
server's record in arrival order: a split brain is a write from the old leader arriving after
the new leader's first write. Builds on ``kmock_harness`` without changing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import kmock
import kopf

from inflight.operator import crd, handlers
from inflight.operator.context import OperatorConfig, OperatorContext
from tests.operator.kmock_harness import OPERATOR_NAMESPACE, ApiServer, Cluster, OperatorThread

_WRITES = {"POST", "PUT", "PATCH", "DELETE"}


@dataclass(frozen=True, slots=True)
class Act:
    at: float  # the server's monotonic clock on arrival
    replica: str  # the bearer token: the replica's identity
    method: str
    path: str


class HangingApiServer(ApiServer):
    """``ApiServer`` plus: Lease writes from the replicas in ``hang_lease_writes`` are held
    unanswered until ``release_hung`` (or the server stops); every write is recorded in ``acts``."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.hang_lease_writes: set[str] = set()
        self.hung: list[str] = []  # replicas whose Lease write is being held, one entry per write
        self.acts: list[Act] = []
        self._released = asyncio.Event()

    def release_hung(self) -> None:
        self._released.set()

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        replica = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        plural = request.resource.plural if request.resource is not None else ""
        if request.method.value in _WRITES and replica:
            if plural == "leases" and replica in self.hang_lease_writes:
                self.hung.append(replica)
                await self._released.wait()  # never answered while the test runs
                raise kmock.KubernetesError(status=504, reason="Timeout", message="held by the test")
            if plural != "leases":
                self.acts.append(Act(time.monotonic(), replica, request.method.value, str(request.url.path)))
        return await super()._handle(request)


def two_leader_window(acts: list[Act], old: str, new: str) -> float:
    """Seconds during which both replicas wrote: from the new leader's first write to the old
    leader's last write after it (0 when the old leader had stopped writing before)."""
    first_new = next((a.at for a in acts if a.replica == new), None)
    if first_new is None:
        return 0.0
    last_old = max((a.at for a in acts if a.replica == old), default=first_new)
    return max(0.0, last_old - first_new)


@contextlib.asynccontextmanager
async def hanging_api_server() -> AsyncIterator[tuple[Cluster, HangingApiServer]]:
    """``kmock_harness.api_server`` with a ``HangingApiServer``."""
    async with HangingApiServer() as api, kmock.Server(api) as server:
        cluster = Cluster(api, str(server.url).rstrip("/"))
        await cluster.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd.build_crd())

        async def garbage_collector() -> None:
            while True:
                await api.collect_garbage()
                await asyncio.sleep(0.1)

        gc = asyncio.create_task(garbage_collector())
        try:
            yield cluster, api
        finally:
            api.release_hung()
            gc.cancel()
            await asyncio.gather(gc, return_exceptions=True)


def start_replica(cluster: Cluster, identity: str, tick_seconds: float = 0.2, **config: Any) -> OperatorThread:
    """One operator replica in a thread of its own, logging in as ``Bearer <identity>``; a lost
    Lease stops it (as the process exit does in production)."""
    stop, ready = threading.Event(), threading.Event()
    registry = kopf.OperatorRegistry()
    handlers.register(registry, tick_seconds=tick_seconds)
    url = cluster.api_url
    ctx = OperatorContext(
        OperatorConfig(tick_seconds=tick_seconds, pod_timeout_seconds=2.0, identity=identity,
                       lease_namespace=OPERATOR_NAMESPACE, **config),
        login=lambda: kopf.ConnectionInfo(server=url, insecure=True, token=identity),
        on_lease_lost=stop.set,
    )

    def run() -> None:
        asyncio.run(kopf.operator(
            registry=registry, clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready,
            memo=kopf.Memo(ctx=ctx), settings=kopf.OperatorSettings(),
        ))

    thread = threading.Thread(target=run, name=f"operator-{identity}", daemon=True)
    thread.start()
    return OperatorThread(thread, ready, stop)
