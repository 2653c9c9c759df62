"""Watch-fed caches of the objects the timer reads, so a tick costs no API request at steady state.

Owns one store per (kind, namespace): filled by one list, then kept by one watch from the list's
resourceVersion (re-watched from the last version seen when the server ends the stream, listed
again on a 410 or a broken stream), plus the operator's own writes, which ``KubeClient.observers``
hand over as the API server answered them (so the next tick does not mistake a write the watch has
not delivered yet for drift). An event or a write older than what the store holds (a smaller
integer resourceVersion) is ignored. Which kinds are watched, and with which label selector, is
``WATCHED``: the children carry ``app.kubernetes.io/managed-by: inflight-operator``, the runtime
pods ``app.kubernetes.io/name: inflight-runtime``; HorizontalPodAutoscalers (foreign ones are
looked for) and PersistentVolumeClaims (one a user made beforehand counts) are watched whole.
Secrets are never watched: the operator may not read them outside its own namespace.

Reads fall back to the API server, never to a stale store (and never wait for one): while a
store's first list has not answered, while its watch is broken, or when the list was refused
(an older chart's RBAC without ``watch``, a kind the cluster lacks: tried again after
``RETRY_AFTER_S``). Knows nothing about what the objects mean.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inflight.operator.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    HPAS,
    INFERENCE_POOLS,
    LEADER_WORKER_SETS,
    PDBS,
    PODS,
    PVCS,
    ROLE_BINDINGS,
    SCALED_OBJECTS,
    SERVICE_ACCOUNTS,
    SERVICES,
    Kind,
    KubeClient,
    KubeError,
)

logger = logging.getLogger(__name__)

MANAGED = {"app.kubernetes.io/managed-by": "inflight-operator"}
WATCHED: dict[Kind, dict[str, str]] = {
    DEPLOYMENTS: MANAGED, SERVICES: MANAGED, CONFIGMAPS: MANAGED, PDBS: MANAGED, INFERENCE_POOLS: MANAGED,
    LEADER_WORKER_SETS: MANAGED, SCALED_OBJECTS: MANAGED, SERVICE_ACCOUNTS: MANAGED, ROLE_BINDINGS: MANAGED,
    PODS: {"app.kubernetes.io/name": "inflight-runtime"}, HPAS: {}, PVCS: {},
}
RETRY_AFTER_S = 60.0  # a refused list (RBAC, a missing kind) is tried again after this long
WATCH_TIMEOUT_S = 300  # the server ends each watch after this long; it is opened again at once
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # between failed re-lists of a store that had synced


def _version(obj: dict[str, Any]) -> int | None:
    text = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    return int(text) if text.isdigit() else None


def _matches(obj: dict[str, Any], labels: dict[str, str]) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


@dataclass(slots=True)
class Store:
    """One kind in one namespace. ``live``: listed and watching now (reads trust it only then)."""

    selector: dict[str, str]
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    version: str = ""  # the last resourceVersion seen (the list's, then each event's)
    live: bool = False
    listed: asyncio.Event = field(default_factory=asyncio.Event)  # the first list answered or failed
    refused_until: float = 0.0  # the list was refused: reads go to the API server until then
    task: asyncio.Task[None] | None = None

    def put(self, obj: dict[str, Any]) -> None:
        """``obj`` unless the store holds a newer version of it (or it no longer matches: then gone)."""
        name = (obj.get("metadata") or {}).get("name") or ""
        held = self.objects.get(name)
        new, old = _version(obj), _version(held) if held is not None else None
        if new is not None and old is not None and new < old:
            return
        if _matches(obj, self.selector):
            self.objects[name] = obj
        else:
            self.objects.pop(name, None)

    def remove(self, obj_name: str, version: int | None = None) -> None:
        held = self.objects.get(obj_name)
        if held is None:
            return
        old = _version(held)
        if version is None or old is None or version >= old:
            del self.objects[obj_name]


class Informers:
    """The stores, started on first read; ``kube`` gives the current client (it changes on re-login)."""

    def __init__(self, kube: Callable[[], KubeClient]) -> None:
        self._kube = kube
        self._stores: dict[tuple[Kind, str], Store] = {}
        self._closed = False  # after close(): no new watch (a round finishing at shutdown reads directly)

    def observe(self, kind: Kind, namespace: str, name: str, obj: dict[str, Any] | None) -> None:
        """A write the operator made (``KubeClient.observers``): the answer, or None when deleted."""
        store = self._stores.get((kind, namespace))
        if store is None or not store.live:
            return
        if obj is None:
            store.remove(name)
        elif (obj.get("metadata") or {}).get("name"):
            store.put(obj)

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object as the cache holds it (a copy), or as the API server answers when the cache can't."""
        store = await self._store(kind, namespace)
        if store is None:
            return await self._kube().get(kind, namespace, name)
        obj = store.objects.get(name)
        return copy.deepcopy(obj) if obj is not None else None

    async def list(self, kind: Kind, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects carrying all ``labels`` (``KubeClient.list``'s answer, from the cache when it can)."""
        store = await self._store(kind, namespace)
        if store is None or not all(labels.get(k) == v for k, v in store.selector.items()):
            return await self._kube().list(kind, namespace, labels)
        return [copy.deepcopy(o) for o in store.objects.values() if _matches(o, labels)]

    def watching(self) -> list[tuple[str, str]]:
        """(plural, namespace) of every store that is live now."""
        return sorted((k.plural, ns) for (k, ns), s in self._stores.items() if s.live)

    async def close(self) -> None:
        self._closed = True
        tasks = [s.task for s in self._stores.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._stores.clear()

    async def _store(self, kind: Kind, namespace: str) -> Store | None:
        selector = WATCHED.get(kind)
        if selector is None or self._closed:
            return None
        key = (kind, namespace)
        store = self._stores.get(key)
        if store is None or (store.task is not None and store.task.done() and time.monotonic() >= store.refused_until):
            store = self._stores[key] = Store(selector)
            store.task = asyncio.create_task(self._run(kind, namespace, store), name=f"watch {kind.plural}/{namespace}")
        return store if store.live else None  # not listed yet (or watch broken): the API server answers

    async def _run(self, kind: Kind, namespace: str, store: Store) -> None:
        selector = ",".join(f"{k}={v}" for k, v in store.selector.items())
        failures = 0
        while True:
            try:
                items, store.version = await self._kube().list_versioned(kind, namespace, selector)
            except KubeError as exc:
                if not store.listed.is_set():  # never synced: the API server answers reads meanwhile
                    logger.warning("not caching %s in %s (reads go to the API server; tried again in %g s): %s",
                                   kind.plural, namespace, RETRY_AFTER_S, exc)
                    store.refused_until = time.monotonic() + RETRY_AFTER_S
                    store.listed.set()
                    return
                failures += 1
                await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S)) - 1])
                continue
            store.objects = {}
            for obj in items:
                store.put(obj)
            store.live = True
            store.listed.set()
            failures = 0
            try:
                await self._watch(kind, namespace, selector, store)
            except KubeError as exc:  # 410 Gone (the version expired) or a broken stream: list again
                store.live = False
                if exc.status != 410:
                    logger.info("watch of %s in %s ended (%s): listing again", kind.plural, namespace, exc)
                    failures += 1
                    await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S)) - 1])

    async def _watch(self, kind: Kind, namespace: str, selector: str, store: Store) -> None:
        while True:  # each stream ends after WATCH_TIMEOUT_S: go on from the last version seen
            async for event in self._kube().watch(kind, namespace, selector, store.version, WATCH_TIMEOUT_S):
                obj = event.get("object") or {}
                if (version := (obj.get("metadata") or {}).get("resourceVersion")):
                    store.version = str(version)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    store.put(obj)
                elif event.get("type") == "DELETED":
                    store.remove((obj.get("metadata") or {}).get("name") or "", _version(obj))
