"""Test harness: the emulated API server (``kmock_api.ApiServer``) over real HTTP, a real kopf
operator (our handlers, a fresh registry) running against it, and the test's handle on both.

Owns ``Cluster`` (API calls against the emulator, the operator's requests counted), the waiting
helpers (``wait_for``, ``wait_ticks``), the RBAC check of every request the operator sent
(``uncovered_requests``) and the ways to run operators: ``running_operator`` (one, in this event
loop), ``start_operator`` and ``start_operator_thread`` (replicas, for HA tests). The API
server's behaviour lives in ``kmock_api``, fake runtime pods in ``kmock_pods``; both are
re-exported here, as tests import them from this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import kmock
import kopf

from inflight.operator import crd, handlers, rbac
from inflight.operator.context import OperatorConfig, OperatorContext
from inflight.operator.operator_metrics import TICKS
from tests.operator.kmock_api import ApiServer
from tests.operator.kmock_faults import Fault
from tests.operator.kmock_pods import FakePod, pod_object

__all__ = [
    "CR_PATH", "OPERATOR_NAMESPACE", "ApiServer", "Cluster", "FakePod", "Fault", "OperatorProcess", "OperatorThread",
    "api_server", "pod_object", "running_operator", "start_operator", "start_operator_thread", "ticks",
    "uncovered_requests", "wait_for", "wait_ticks",
]

CR_PATH = "/apis/inflight.dev/v1alpha1/namespaces/{ns}/inferencedeployments"
OPERATOR_NAMESPACE = "inflight-system"  # the test operators' own (the root key, the Lease)


class Cluster:
    """The test's handle: API calls against the emulator and waiting helpers."""

    def __init__(self, api: ApiServer, api_url: str = "") -> None:
        self.api = api
        self.api_url = api_url  # the emulator's base URL, for real clients (kubectl)
        self.operator_ctx: OperatorContext | None = None  # running_operator's, for tests that look inside

    async def request(self, method: str, path: str, body: Any = None, merge: bool = False) -> dict[str, Any]:
        headers = {"Content-Type": "application/merge-patch+json"} if merge else {}
        async with self.api.request(method, path, json=body, headers=headers) as resp:
            data = await resp.json(content_type=None)
            if resp.status >= 400:
                raise AssertionError(f"{method} {path}: {resp.status} {data}")
            return data

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.request("POST", path, body)

    async def get(self, path: str) -> dict[str, Any] | None:
        async with self.api.get(path) as resp:
            return await resp.json() if resp.status == 200 else None

    async def create_cr(self, doc: dict[str, Any], ns: str = "default") -> dict[str, Any]:
        return await self.create(CR_PATH.format(ns=ns), doc)

    async def cr(self, name: str, ns: str = "default") -> dict[str, Any] | None:
        return await self.get(f"{CR_PATH.format(ns=ns)}/{name}")

    async def patch_cr(self, name: str, patch: dict[str, Any], ns: str = "default") -> dict[str, Any]:
        return await self.request("PATCH", f"{CR_PATH.format(ns=ns)}/{name}", patch, merge=True)

    async def child(self, kind: str, name: str, ns: str = "default") -> dict[str, Any] | None:
        prefix = {"deployments": "/apis/apps/v1", "poddisruptionbudgets": "/apis/policy/v1"}.get(kind, "/api/v1")
        return await self.get(f"{prefix}/namespaces/{ns}/{kind}/{name}")

    def requests_to(self, method: str, path_part: str) -> int:
        return sum(1 for r in list(self.api) if r.method.value == method and path_part in str(r.url.path))


def ticks() -> float:
    """Timer rounds started so far by every operator in this process (``inflight_operator_ticks``)."""
    return TICKS._value.get()


async def wait_ticks(count: int, timeout: float = 10.0) -> None:
    """Wait until ``count`` more timer rounds have started (in every operator of this process)."""
    start = ticks()

    async def done() -> bool:
        return ticks() >= start + count

    await wait_for(done, timeout, what=f"{count} ticks")


async def wait_for(check: Callable[[], Awaitable[Any]], timeout: float = 10.0, what: str = "") -> Any:
    """Poll ``check`` until it returns a truthy value; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        await asyncio.sleep(0.05)


def uncovered_requests(api: ApiServer) -> list[str]:
    """Requests the operator sent that REQUIRED_PERMISSIONS does not grant (the tests' own
    requests, from kmock's client or kubectl, are a user's, not the operator's)."""
    verbs = {kmock.action.FETCH: "get", kmock.action.LIST: "list", kmock.action.WATCH: "watch",
             kmock.action.CREATE: "create", kmock.action.DELETE: "delete"}
    missing = set()
    for req in list(api):
        res = req.resource
        agent = req.headers.get("User-Agent", "")
        if res is None or req.action is None or not res.plural or "kmock" in agent or agent.startswith("kubectl"):
            continue
        verb = verbs.get(req.action) or ("patch" if req.method.value == "PATCH" else "update")
        plural = f"{res.plural}/{req.subresource}" if req.subresource else res.plural
        if not rbac.allows(res.group or "", plural, verb, own_namespace=req.namespace == OPERATOR_NAMESPACE):
            missing.add(f"{verb} {res.group or 'core'}/{plural}")
    return sorted(missing)


@contextlib.asynccontextmanager
async def api_server() -> AsyncIterator[Cluster]:
    """kmock serving the CRD over real HTTP on 127.0.0.1."""
    async with ApiServer() as api, kmock.Server(api) as server:
        cluster = Cluster(api, str(server.url).rstrip("/"))
        await cluster.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd.build_crd())

        async def garbage_collector() -> None:  # kube-controller-manager's, every 0.1 s
            while True:
                await api.collect_garbage()
                await asyncio.sleep(0.1)

        gc = asyncio.create_task(garbage_collector())
        try:
            yield cluster
        finally:
            api.released.set()
            gc.cancel()
            await asyncio.gather(gc, return_exceptions=True)


@dataclass
class OperatorProcess:
    """One in-process operator: its kopf task, flags and context (a replica, in HA tests)."""

    task: asyncio.Task[None]
    ready: asyncio.Event
    stop: asyncio.Event
    ctx: OperatorContext

    async def shutdown(self) -> None:
        self.stop.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self.task, 10)


def _operator_parts(cluster: Cluster, tick_seconds: float, stop: Any, config: dict[str, Any]
                    ) -> tuple[kopf.OperatorRegistry, OperatorContext]:
    """A fresh registry with our handlers, and a context logged in to ``cluster`` whose lost
    lease sets ``stop``."""
    registry = kopf.OperatorRegistry()
    handlers.register(registry, tick_seconds=tick_seconds)
    url = cluster.api_url
    ctx = OperatorContext(
        OperatorConfig(tick_seconds=tick_seconds, pod_timeout_seconds=2.0,
                       **{"lease_namespace": OPERATOR_NAMESPACE, **config}),
        login=lambda: kopf.ConnectionInfo(server=url, insecure=True),
        on_lease_lost=stop.set,
    )
    return registry, ctx


def start_operator(cluster: Cluster, tick_seconds: float = 0.2, **config: Any) -> OperatorProcess:
    """Our kopf handlers in a background task against ``cluster`` (``config``: more
    OperatorConfig fields, e.g. the leader-election Lease)."""
    stop, ready = asyncio.Event(), asyncio.Event()
    registry, ctx = _operator_parts(cluster, tick_seconds, stop, config)
    task = asyncio.create_task(kopf.operator(
        registry=registry, clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready,
        memo=kopf.Memo(ctx=ctx), settings=kopf.OperatorSettings(),
    ))
    return OperatorProcess(task, ready, stop, ctx)


@dataclass
class OperatorThread:
    """An operator replica on an event loop of its own, in a thread: kopf cancels every task
    created in its loop after it started when it stops, so two replicas cannot share a loop
    (in production they are two processes)."""

    thread: threading.Thread
    ready: threading.Event
    stop: threading.Event

    async def wait_ready(self, timeout: float) -> bool:
        return await asyncio.to_thread(self.ready.wait, timeout)

    async def shutdown(self) -> None:
        self.stop.set()
        await asyncio.to_thread(self.thread.join, 15)


def start_operator_thread(cluster: Cluster, tick_seconds: float = 0.2, **config: Any) -> OperatorThread:
    """Like :func:`start_operator`, in a thread of its own."""
    stop, ready = threading.Event(), threading.Event()
    registry, ctx = _operator_parts(cluster, tick_seconds, stop, config)

    def run() -> None:
        asyncio.run(kopf.operator(
            registry=registry, clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready,
            memo=kopf.Memo(ctx=ctx), settings=kopf.OperatorSettings(),
        ))

    thread = threading.Thread(target=run, name=f"operator-{config.get('identity', '')}", daemon=True)
    thread.start()
    return OperatorThread(thread, ready, stop)


@contextlib.asynccontextmanager
async def running_operator(tick_seconds: float = 0.2, **config: Any) -> AsyncIterator[Cluster]:
    """kmock + our kopf handlers in a background task (``config``: more OperatorConfig fields);
    stops the operator on exit."""
    async with api_server() as cluster:
        operator = start_operator(cluster, tick_seconds, **config)
        cluster.operator_ctx = operator.ctx
        try:
            await asyncio.wait_for(operator.ready.wait(), 10)
            yield cluster
            assert not uncovered_requests(cluster.api), f"RBAC misses: {uncovered_requests(cluster.api)}"
        finally:
            await operator.shutdown()
