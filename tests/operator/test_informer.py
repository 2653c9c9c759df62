"""The watch-fed caches (``informer``): at steady state a tick sends no read and no write (but the
admin Secret's existence check, a create answered 409, once per full check), however many CRs;
a child deleted or edited behind the operator's back is seen by the watch and put back; a store
never serves an older version than it holds; a refused watch falls back to reads, not to nothing."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from inflight.operator.informer import Informers, Store
from inflight.operator.kube import CONFIGMAPS, DEPLOYMENTS
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_faults import Fault
from tests.operator.kmock_harness import Cluster, running_operator, ticks, wait_for, wait_ticks

DEPLOYS = "/apis/apps/v1/namespaces/default/deployments"
SERVICES = "/api/v1/namespaces/default/services"
CONFIGMAPS_PATH = "/api/v1/namespaces/default/configmaps"


def _minimal(name: str) -> dict[str, Any]:
    doc = copy.deepcopy(load_example(next(p for p in EXAMPLES if p.stem == "minimal")))
    doc["metadata"]["name"] = name
    return doc


def _operator_requests(cluster: Cluster, since: int = 0) -> list[Any]:
    return [r for r in list(cluster.api)[since:] if "kmock" not in r.headers.get("User-Agent", "")]


def _is_watch(request: Any) -> bool:
    return request.params.get("watch") in ("true", "True", "1")


async def _settled(cluster: Cluster, names: list[str]) -> None:
    async def ticking() -> bool:
        crs = [await cluster.cr(n) for n in names]
        return all(cr and "readyReplicas" in (cr.get("status") or {}) for cr in crs)

    await wait_for(ticking, timeout=90, what="every CR's first ticks")
    await wait_ticks(6 * len(names), timeout=60)  # past a full check of each


async def _steady_state_requests(num_crs: int) -> tuple[list[Any], float]:
    async with running_operator() as cluster:
        names = [f"m{i}" for i in range(num_crs)]
        for name in names:
            await cluster.create_cr(_minimal(name))
        await _settled(cluster, names)
        sent, start = len(list(cluster.api)), ticks()
        await wait_ticks(12 * num_crs, timeout=90)
        return _operator_requests(cluster, sent), ticks() - start


def test_at_steady_state_a_tick_reads_nothing_and_writes_nothing_whatever_the_number_of_crs() -> None:
    for num_crs in (1, 4):
        window, num_ticks = asyncio.run(asyncio.wait_for(_steady_state_requests(num_crs), 240))
        reads = [f"{r.method.value} {r.url.path}" for r in window if r.method.value == "GET" and not _is_watch(r)]
        assert reads == [], reads  # not O(CRs x children) GETs per tick: none
        writes = [f"{r.method.value} {r.url.path}" for r in window if r.method.value != "GET"]
        # The admin Secret can't be watched (no Secret outside the operator's namespace is readable):
        # its existence check, a create answered 409, is the only request, once per full check (every 6th tick).
        assert all(w == "POST /api/v1/namespaces/default/secrets" for w in writes), writes
        assert len(writes) <= num_ticks / 6 + num_crs, (len(writes), num_ticks)


def test_a_child_deleted_or_edited_behind_the_operators_back_is_put_back_from_the_watch() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            await cluster.create_cr(_minimal("svc"))
            await _settled(cluster, ["svc"])
            service = await cluster.child("services", "svc")
            deploy = await cluster.child("deployments", "svc")
            sent = len(list(cluster.api))
            await cluster.request("DELETE", f"{SERVICES}/svc")
            await cluster.request("DELETE", f"{DEPLOYS}/svc")
            await cluster.request("PATCH", f"{CONFIGMAPS_PATH}/svc-live-config",
                                  {"metadata": {"labels": {"app.kubernetes.io/instance": "edited"}}}, merge=True)

            async def back(kind: str, old: dict[str, Any]) -> bool:
                obj = await cluster.child(kind, "svc")
                return bool(obj and obj["metadata"]["uid"] != old["metadata"]["uid"])

            await wait_for(lambda: back("services", service), timeout=30, what="the Service re-created")
            await wait_for(lambda: back("deployments", deploy), timeout=30, what="the Deployment re-created")

            async def reverted() -> bool:
                cm = await cluster.child("configmaps", "svc-live-config")
                return bool(cm and cm["metadata"]["labels"]["app.kubernetes.io/instance"] == "svc")

            await wait_for(reverted, timeout=30, what="the hand edit reverted")
            window = _operator_requests(cluster, sent)
            # The watch saw it: no GET of the Service or ConfigMap by name (the rollout gate reads
            # the Deployment it is about to write; nothing polls).
            assert not [r for r in window if r.method.value == "GET" and not _is_watch(r)
                        and str(r.url.path) in (f"{SERVICES}/svc", f"{CONFIGMAPS_PATH}/svc-live-config")]

    asyncio.run(asyncio.wait_for(scenario(), 180))


def test_a_refused_watch_falls_back_to_reading_the_api_server() -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            # An older chart's RBAC: no list/watch of Deployments.
            cluster.api.faults.append(_ListFault("GET", DEPLOYS, 403, "Forbidden", "cannot list deployments"))
            await cluster.create_cr(_minimal("old"))
            await _settled(cluster, ["old"])
            reads = cluster.requests_to("GET", f"{DEPLOYS}/old")
            await wait_ticks(5, timeout=30)
            assert cluster.requests_to("GET", f"{DEPLOYS}/old") >= reads + 4  # read each tick, not stale
            await cluster.request("PATCH", f"{DEPLOYS}/old/status", {"status": {"readyReplicas": 1}}, merge=True)

            async def ready() -> bool:
                return ((await cluster.cr("old")) or {}).get("status", {}).get("readyReplicas") == 1

            await wait_for(ready, timeout=30, what="the status from a direct read")

    asyncio.run(asyncio.wait_for(scenario(), 180))


class _ListFault(Fault):
    """A fault on lists and watches only (a request with no object name)."""

    def matches(self, request: Any) -> bool:
        return request.name is None and super().matches(request)


def _obj(name: str, version: int, value: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": str(version),
                         "labels": {"app.kubernetes.io/managed-by": "inflight-operator"} if labels is None else labels},
            "data": {"k": value}}


def test_a_store_keeps_the_newest_version_it_saw() -> None:
    store = Store({"app.kubernetes.io/managed-by": "inflight-operator"})
    store.put(_obj("a", 5, "written"))  # the operator's own write, answered at version 5
    store.put(_obj("a", 4, "older"))  # the watch delivering an event from before that write
    assert store.objects["a"]["data"]["k"] == "written"
    store.put(_obj("a", 6, "newer"))
    assert store.objects["a"]["data"]["k"] == "newer"
    store.remove("a", 5)  # a deletion older than what is held
    assert "a" in store.objects
    store.put(_obj("a", 7, "unlabelled", labels={}))  # no longer selected: gone from the store
    assert "a" not in store.objects
    store.put(_obj("b", 1, "x"))
    store.remove("b", 2)
    assert store.objects == {}


def test_the_cache_is_told_of_the_operators_own_writes() -> None:
    informers = Informers(lambda: None)  # type: ignore[arg-type,return-value]
    store = Store(informers_selector := {"app.kubernetes.io/managed-by": "inflight-operator"}, live=True)
    informers._stores[(CONFIGMAPS, "default")] = store
    informers.observe(CONFIGMAPS, "default", "a", _obj("a", 3, "written"))
    assert store.objects["a"]["data"]["k"] == "written"
    informers.observe(CONFIGMAPS, "default", "a", None)  # deleted by the operator
    assert "a" not in store.objects
    informers.observe(DEPLOYMENTS, "default", "b", _obj("b", 1, "x"))  # no store for that kind: nothing
    assert informers_selector == store.selector and list(informers._stores) == [(CONFIGMAPS, "default")]

    async def scenario() -> None:  # and the operator's client tells it of every write
        async with running_operator() as cluster:
            await cluster.create_cr(_minimal("own"))
            await _settled(cluster, ["own"])
            ctx = cluster.operator_ctx
            assert ctx is not None and ctx.informers is not None
            assert ("deployments", "default") in ctx.informers.watching()
            assert ctx.informers.observe in ctx.kube.observers
            await ctx.kube.patch(CONFIGMAPS, "default", "own-live-config", {"data": {"extra": "1"}})
            cached = await ctx.informers.get(CONFIGMAPS, "default", "own-live-config")
            assert cached is not None and cached["data"]["extra"] == "1"

    asyncio.run(asyncio.wait_for(scenario(), 180))
