"""Test harness: a kmock API server with the bits of API-server behaviour the operator relies on,
a real kopf operator (our handlers, a fresh registry) running against it, and fake runtime pods.

kmock stores objects and serves list/watch but does not assign uid, creationTimestamp,
resourceVersion or metadata.generation, does not bump generation on spec changes and ignores
generateName; ``ApiServer`` adds exactly that, refuses a patch whose ``metadata.resourceVersion``
is not the object's (409, the API server's optimistic concurrency), and garbage-collects
objects whose owners are gone (``collect_garbage``, run every 0.1 s as the controller manager's
collector would). For the real ``kubectl`` it also serves the
resources' singular and short names in discovery (``kubectl get infd``) and OpenAPI v3
(``/openapi/v3`` and one document per group/version holding the CRD's schema under its GVK), so
``kubectl apply`` validates manifests against the CRD client-side, as it does when a server does
not advertise server-side field validation. Every request the operator sends is kept, so
tests can check each is covered by ``inflight.operator.rbac.REQUIRED_PERMISSIONS``. Tests choose
the answer to chosen requests (``Fault``: a webhook's or a quota's 403, 409, 422, 5xx, or no
answer at all) and can mutate what is written (``ApiServer.mutators``, a mutating webhook).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import itertools
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import aiohttp.web
import kmock
import kopf

from inflight.operator import crd, handlers, rbac, render
from inflight.operator.context import OperatorConfig, OperatorContext
from inflight.operator.operator_metrics import TICKS
from tests.operator import kmock_faults, kmock_schema
from tests.operator.kmock_faults import Fault

CR_PATH = "/apis/inflight.dev/v1alpha1/namespaces/{ns}/inferencedeployments"
OPERATOR_NAMESPACE = "inflight-system"  # the test operators' own (the root key, the Lease)
_RESOURCES = {
    "inflight.dev/v1alpha1/inferencedeployments": ("InferenceDeployment", True, {"status", "scale"}),
    "apps/v1/deployments": ("Deployment", True, {"status", "scale"}),
    "policy/v1/poddisruptionbudgets": ("PodDisruptionBudget", True, {"status"}),
    "v1/services": ("Service", True, {"status"}),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/pods": ("Pod", True, {"status"}),
    "v1/secrets": ("Secret", True, set()),
    "v1/persistentvolumeclaims": ("PersistentVolumeClaim", True, {"status"}),
    "inference.networking.k8s.io/v1/inferencepools": ("InferencePool", True, {"status"}),
    "v1/events": ("Event", True, set()),
    "coordination.k8s.io/v1/leases": ("Lease", True, set()),
    "autoscaling/v2/horizontalpodautoscalers": ("HorizontalPodAutoscaler", True, {"status"}),
    "keda.sh/v1alpha1/scaledobjects": ("ScaledObject", True, {"status"}),
    "v1/serviceaccounts": ("ServiceAccount", True, set()),
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True, set()),
    "v1/namespaces": ("Namespace", False, set()),
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False, {"status"}),
}
_VERBS = ["get", "list", "watch", "create", "update", "patch", "delete"]
_SHORT_NAMES = {"inferencedeployments": {"infd"}, "deployments": {"deploy"}, "services": {"svc"},
                "poddisruptionbudgets": {"pdb"}, "configmaps": {"cm"}, "persistentvolumeclaims": {"pvc"},
                "inferencepools": {"infpool"}, "events": {"ev"}, "namespaces": {"ns"}}


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(base.get(key), value)
    return out


class ApiServer(kmock.KubernetesEmulator):
    """kmock plus uid/creationTimestamp/resourceVersion/generation and generateName."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        # Object names whose create the "API server" refuses with 422 and this message (as a real
        # one refuses, say, an invalid volume source the operator passed through).
        self.reject_creates: dict[str, str] = {}
        # Chosen answers (a webhook's 403, a quota, 409, 5xx, a hang): the first that matches wins.
        self.faults: list[Fault] = []
        self.released = asyncio.Event()  # set at teardown: hanging requests are answered 503 then
        # Mutating webhooks: called with (plural, the object or merge patch being written) on every
        # create and update of the object itself by anyone but the test; they change it in place.
        self.mutators: list[Callable[[str, dict[str, Any]], None]] = []
        for key, (kind, namespaced, subresources) in _RESOURCES.items():
            plural = key.rsplit("/", 1)[1]
            self.resources[key] = kmock.ResourceInfo(
                kind=kind, namespaced=namespaced, verbs=set(_VERBS), subresources=subresources,
                singular=kind.lower(), shortnames=_SHORT_NAMES.get(plural, set()),
            )

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.url.path.startswith("/openapi/"):
            return self._openapi(request.url.path)
        await self._inject_fault(request)
        self._mutate(request)
        if request.resource is not None and isinstance(request.data, list) and request.action == kmock.action.UPDATE:
            self._check_json_patch_tests(request)
        if request.resource is not None and isinstance(request.data, dict):
            if request.action in (kmock.action.CREATE, kmock.action.UPDATE):
                self._check_strict(request)
            if request.action == kmock.action.CREATE:
                self._default(request)
            if request.action == kmock.action.CREATE:
                res = request.resource
                if not any(known == res for known in self.resources):  # kmock would store it anyway
                    raise kmock.KubernetesResourceNotFoundError()
                name = (request.data.get("metadata") or {}).get("name")
                if name in self.reject_creates and request.resource.plural == "deployments":
                    raise kmock.KubernetesError(status=422, reason="Invalid", message=self.reject_creates[name])
                self._on_create(request.data)
            elif request.action == kmock.action.UPDATE and request.name is not None:
                self._on_update(request)
        return await super()._handle(request)

    async def _inject_fault(self, request: kmock.Request) -> None:
        await kmock_faults.inject(self.faults, self.released, request)

    def _mutate(self, request: kmock.Request) -> None:
        kmock_faults.mutate(self.mutators, request)

    async def collect_garbage(self) -> int:
        """One pass of the garbage collector (background propagation): delete every object
        whose owners (``metadata.ownerReferences`` uids) are all gone. Returns how many."""
        collected = 0
        async with self._lock:
            live = {(obj.raw.get("metadata") or {}).get("uid") for obj in self.objects.values() if not obj.deleted}
            for (resource, _, _), obj in list(self.objects.items()):
                if obj.deleted:
                    continue
                owners = [o.get("uid") for o in (obj.raw.get("metadata") or {}).get("ownerReferences") or []]
                if owners and not any(uid in live for uid in owners):
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})
                    collected += 1
        return collected

    def _crds(self) -> list[dict[str, Any]]:
        return [obj.raw for (res, _, _), obj in list(self.objects.items())
                if res.plural == "customresourcedefinitions" and not obj.deleted]

    def _openapi(self, path: str) -> aiohttp.web.Response:
        schemas = kmock_schema.crd_schemas(self._crds())
        if path.rstrip("/") == "/openapi/v3":
            return aiohttp.web.json_response(kmock_schema.openapi_root(schemas))
        doc = kmock_schema.openapi_group_version(schemas, path.removeprefix("/openapi/v3/apis/"))
        if doc is None:
            return aiohttp.web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        return aiohttp.web.json_response(doc)

    def _check_json_patch_tests(self, request: kmock.Request) -> None:
        """A failed JSON-patch ``test`` op is a 422 from the API server (kmock answers 500), which
        is what kopf's optimistic finalizer/annotation patches expect before re-reading."""
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return
        current: Any = self.objects[key].raw
        for op in request.data:
            if not isinstance(op, dict) or op.get("op") != "test":
                continue
            value: Any = current
            for part in str(op.get("path", "")).lstrip("/").split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                value = value.get(part) if isinstance(value, dict) else None
            if value != op.get("value"):
                raise kmock.KubernetesError(
                    status=422, reason="Invalid",
                    message=f"the server rejected our request due to an error in our request: "
                            f"test of {op.get('path')} failed",
                )

    def _default(self, request: kmock.Request) -> None:
        """CRD defaulting of a created custom object (the API server does it on every write; on
        create is where the operator's objects get theirs)."""
        res = request.resource
        entry = kmock_schema.crd_schemas(self._crds()).get(f"{res.group}/{res.version}")
        if entry is None or entry[1] != res.plural:
            return
        defaulted = kmock_schema.apply_defaults(request.data, entry[3])
        request.data.clear()
        request.data.update(defaulted)

    def _check_strict(self, request: kmock.Request) -> None:
        """``?fieldValidation=Strict`` on a custom object: a 422 like the API server's, or nothing."""
        if request.params.get("fieldValidation") != "Strict" or request.subresource is not None:
            return
        res = request.resource
        entry = kmock_schema.crd_schemas(self._crds()).get(f"{res.group}/{res.version}")
        if entry is None or not isinstance(request.data, dict):
            return
        obj = request.data
        key = (res, request.namespace, request.name)
        if request.action == kmock.action.UPDATE and key in self.objects:
            obj = _merge(self.objects[key].raw, request.data)
        if errors := kmock_schema.strict_errors(obj, entry[3]):
            name = (obj.get("metadata") or {}).get("name")
            raise kmock.KubernetesError(
                status=422, reason="Invalid",
                message=f'{entry[0]}.{res.group} "{name}" is invalid: ' + "; ".join(errors),
            )

    async def _serve_version(self, request: kmock.Request) -> Any:
        """Discovery as the API server has it: short names on resources, not on their subresources."""
        doc = await super()._serve_version(request)
        for entry in doc["resources"]:
            if "/" in entry["name"]:
                entry["shortNames"] = []
        return doc

    async def _serve_list(self, request: kmock.Request) -> Any:
        """Lists carry ``kind: <Kind>List`` and ``apiVersion`` (kubectl's decoder needs them)."""
        doc = await super()._serve_list(request)
        info = self.resources[f"{request.resource.group}/{request.resource.version}/{request.resource.plural}"
                              if request.resource.group else f"{request.resource.version}/{request.resource.plural}"]
        gv = f"{request.resource.group}/{request.resource.version}" if request.resource.group else request.resource.version
        return {"apiVersion": gv, "kind": f"{info.kind}List", **doc}

    def _on_create(self, data: dict[str, Any]) -> None:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = f"{meta['generateName']}{uuid.uuid4().hex[:8]}"
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["generation"] = 1
        meta["resourceVersion"] = str(next(self._versions))

    def _on_update(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return
        current = self.objects[key].raw
        meta = request.data.setdefault("metadata", {})
        wanted = meta.get("resourceVersion")  # a precondition, as the API server treats it
        if wanted is not None and wanted != (current.get("metadata") or {}).get("resourceVersion"):
            raise kmock.KubernetesError(
                status=409, reason="Conflict",
                message=f'Operation cannot be fulfilled on {request.resource.plural} "{request.name}": '
                        "the object has been modified; please apply your changes to the latest version")
        meta["resourceVersion"] = str(next(self._versions))
        old_gen = (current.get("metadata") or {}).get("generation", 1)
        if request.subresource is None and "spec" in request.data:
            if _merge(current.get("spec") or {}, request.data["spec"]) != (current.get("spec") or {}):
                meta["generation"] = old_gen + 1


@dataclass
class FakePod:
    """A runtime stand-in on 127.0.0.1: serves /metrics, /health, /ready; records POST /admin/config."""

    kv_cache_usage: float = 0.0
    num_waiting: float = 0.0
    admin_posts: list[tuple[dict[str, Any], str | None]] = field(default_factory=list)
    port: int = 0
    _runner: aiohttp.web.AppRunner | None = None

    async def start(self) -> FakePod:
        app = aiohttp.web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/admin/config", self._admin)
        self._runner = aiohttp.web.AppRunner(app)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        text = (
            "# TYPE inflight:kv_cache_usage_perc gauge\n"
            f'inflight:kv_cache_usage_perc{{model_name="m"}} {self.kv_cache_usage}\n'
            "# TYPE inflight:num_requests_waiting gauge\n"
            f'inflight:num_requests_waiting{{model_name="m"}} {self.num_waiting}\n'
        )
        return aiohttp.web.Response(text=text)

    async def _admin(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.admin_posts.append((await request.json(), request.headers.get("Authorization")))
        return aiohttp.web.json_response({})


def pod_object(name: str, instance: str, port: int, ns: str = "default", ready: bool = True) -> dict[str, Any]:
    """A Pod as the API server would show it, pointing at 127.0.0.1:port (its container port
    named ``http``, as the operator renders it). The ``prometheus.io/port`` annotation is what
    a mesh (Istio's metrics merging) leaves there: the operator must not follow it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name, "namespace": ns, "labels": render.common_labels(instance),
            "annotations": {"prometheus.io/port": "15020"},
        },
        "spec": {"containers": [{"name": "runtime", "image": "x",
                                 "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]}]},
        "status": {
            "phase": "Running", "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


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
