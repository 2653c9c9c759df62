"""Least privilege: an operator started for a list of namespaces (the chart's watchNamespaces:
``kopf run --namespace=A --namespace=B``) reconciles InferenceDeployments there and ignores one
in a namespace it does not watch: no child, no finalizer, no status, and not a single namespaced
request outside its namespaces (what its per-namespace Roles would refuse)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import kopf

from tests.operator.kmock_harness import OPERATOR_NAMESPACE, Cluster, _operator_parts, api_server, wait_for

WATCHED = ["team-a", "team-b"]
UNWATCHED = "team-c"


def _doc(name: str, ns: str) -> dict[str, Any]:
    return {"apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"servedModelName": "demo", "hostPath": {"path": "/models/demo"}},
                     "resources": {"gpus": 0}}}


async def _status_written(cluster: Cluster, name: str, ns: str) -> bool:
    cr = await cluster.cr(name, ns)
    return bool((cr or {}).get("status", {}).get("conditions"))


def test_an_object_in_an_unwatched_namespace_is_ignored() -> None:
    async def scenario() -> None:
        async with api_server() as cluster:
            stop, ready = asyncio.Event(), asyncio.Event()
            registry, ctx = _operator_parts(cluster, 0.2, stop, {})
            for ns in [*WATCHED, UNWATCHED]:
                await cluster.create_cr(_doc(f"m-{ns}", ns), ns)
            task = asyncio.create_task(kopf.operator(
                registry=registry, namespaces=WATCHED, clusterwide=False, standalone=True, stop_flag=stop,
                ready_flag=ready, memo=kopf.Memo(ctx=ctx), settings=_settings()))
            try:
                await asyncio.wait_for(ready.wait(), 10)
                for ns in WATCHED:
                    await wait_for(lambda ns=ns: cluster.child("deployments", f"m-{ns}", ns), timeout=20,
                                   what=f"the Deployment in {ns}")
                    await wait_for(lambda ns=ns: _status_written(cluster, f"m-{ns}", ns), timeout=20,
                                   what=f"the status in {ns}")
                await asyncio.sleep(1.0)  # several ticks of the watched ones
                assert await cluster.child("deployments", f"m-{UNWATCHED}", UNWATCHED) is None
                ignored = await cluster.cr(f"m-{UNWATCHED}", UNWATCHED)
                assert ignored is not None and not ignored.get("status")
                assert not ignored["metadata"].get("finalizers")
                outside = _requests_outside(cluster)
                assert outside == [], outside
            finally:
                stop.set()
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(task, 10)

    asyncio.run(asyncio.wait_for(scenario(), 90))


def _settings() -> kopf.OperatorSettings:
    """kopf's namespace scanning off: kmock 0.8 answers ``GET /api/v1/namespaces`` (the cluster-scoped
    list kopf observes in namespaced mode) with a 500 (it parses the path as namespaced). With
    exact names, as the chart passes them, kopf needs no scan; the ClusterRole still grants it."""
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    return settings


def _requests_outside(cluster: Cluster) -> list[str]:
    """The operator's requests for namespaced resources outside its namespaces (the watched ones
    and its own), listing across all namespaces included."""
    allowed = {*WATCHED, OPERATOR_NAMESPACE}
    cluster_scoped = {"namespaces", "customresourcedefinitions"}
    found = []
    for req in list(cluster.api):
        res = req.resource
        if res is None or not res.plural or "kmock" in req.headers.get("User-Agent", ""):
            continue
        if res.plural in cluster_scoped:
            continue
        if req.namespace not in allowed:
            found.append(f"{req.method.value} {req.url.path}")
    return sorted(set(found))
