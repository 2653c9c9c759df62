"""The emulated API server: kmock with the bits of API-server behaviour the operator relies on.

kmock stores objects and serves list/watch but does not assign uid, creationTimestamp,
resourceVersion or metadata.generation, does not bump generation on spec changes and ignores
generateName; ``ApiServer`` adds exactly that, refuses a patch whose ``metadata.resourceVersion``
is not the object's (409, the API server's optimistic concurrency), and garbage-collects
objects whose owners are gone (``collect_garbage``, run every 0.1 s as the controller manager's
collector would). For the real ``kubectl`` it also serves the
resources' singular and short names in discovery (``kubectl get infd``) and OpenAPI v3
(``/openapi/v3`` and one document per group/version holding the CRD's schema under its GVK), so
``kubectl apply`` validates manifests against the CRD client-side, as it does when a server does
not advertise server-side field validation. Every request is kept (``kmock_log.RequestLog``: out
of kmock's own reaction matching, which made each request cost more than the last), so tests
can check each the operator sent is covered by ``inflight.operator.rbac.REQUIRED_PERMISSIONS``.
Tests choose the answer to chosen requests (``Fault``: a webhook's or a quota's 403, 409, 422,
5xx, or no answer at all) and can mutate what is written (``ApiServer.mutators``, a mutating
webhook). Knows nothing about the operator.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp.web
import kmock

from tests.operator import kmock_faults, kmock_schema
from tests.operator.kmock_faults import Fault
from tests.operator.kmock_log import RequestLog

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


class ApiServer(RequestLog, kmock.KubernetesEmulator):
    """kmock plus uid/creationTimestamp/resourceVersion/generation and generateName."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._init_log()
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
