"""All of the operator's own Kubernetes API I/O, through the ``kubernetes`` package's asyncio client.

Owns: which client API serves each kind the operator touches (``kubernetes.aio``'s typed
``CoreV1Api``/``AppsV1Api``/``PolicyV1Api``, ``CustomObjectsApi`` for custom resources; the
``kubernetes`` package is the Kubernetes project's own Python client),
authentication from a ``kopf.ConnectionInfo`` (the credentials kopf logged in with: its
Authorization header, CA and client certificate, the latter two written to private temp
files because the client reads them from paths), get/list/create/patch/delete,
create-or-patch (a 409 on create is not an error: the object is merge-patched), Events, and
watches (a list's resourceVersion, then the event stream, on a connection pool of their own; the
caches they feed are ``informer``'s, told of every write the operator makes through ``observers``). The client's typed methods build every request (paths, query parameters, content
types, auth); bodies are sent as the JSON dicts they are and answers are read as JSON dicts
(camelCase, as the API server writes them), so the rest of the operator works on JSON-shaped
values and no field newer than the client is lost. For that the typed methods are called
undecorated (``raw_function``, pydantic's handle on the function ``validate_call`` wraps): the
decorated ones would convert a dict body into the client's model, which refuses fields it does
not know and a number where it types a string (a quantity written ``1``), both of which the API
server takes.

Patch strategy: JSON merge patch (RFC 7386) everywhere, forced with ``_content_type`` (the
client would pick strategic merge for dict bodies). Why: custom resources (the
InferenceDeployment's status, InferencePool) accept no strategic merge patch; a merge patch
means the same thing on every kind and every API server, the kmock emulator included; the
operator owns the whole pod template, so replacing lists wholesale is what it wants, and
optional keys it stops setting are sent as ``null`` (``render.deployment_patch``).
Knows nothing about what it writes.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import json
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf
from kubernetes.aio import client
from kubernetes.aio.client.exceptions import ApiException

from inflight.operator import applied

MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True, slots=True)
class Kind:
    api_version: str  # "v1", "apps/v1", ...
    plural: str
    kind: str
    api: str = "CustomObjectsApi"  # the kubernetes.aio API class serving it
    method: str = ""  # typed method suffix, e.g. "namespaced_deployment"; "" for custom objects

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]


INFERENCE_POOLS = Kind("inference.networking.k8s.io/v1", "inferencepools", "InferencePool")
INFERENCE_DEPLOYMENTS = Kind("inflight.dev/v1alpha1", "inferencedeployments", "InferenceDeployment")
LEADER_WORKER_SETS = Kind("leaderworkerset.x-k8s.io/v1", "leaderworkersets", "LeaderWorkerSet")  # spec.nodes > 1
DEPLOYMENTS = Kind("apps/v1", "deployments", "Deployment", "AppsV1Api", "namespaced_deployment")
SERVICES = Kind("v1", "services", "Service", "CoreV1Api", "namespaced_service")
PDBS = Kind("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", "PolicyV1Api",
            "namespaced_pod_disruption_budget")
CONFIGMAPS = Kind("v1", "configmaps", "ConfigMap", "CoreV1Api", "namespaced_config_map")
PODS = Kind("v1", "pods", "Pod", "CoreV1Api", "namespaced_pod")
SECRETS = Kind("v1", "secrets", "Secret", "CoreV1Api", "namespaced_secret")
PVCS = Kind("v1", "persistentvolumeclaims", "PersistentVolumeClaim", "CoreV1Api",
            "namespaced_persistent_volume_claim")
EVENTS = Kind("v1", "events", "Event", "CoreV1Api", "namespaced_event")
LEASES = Kind("coordination.k8s.io/v1", "leases", "Lease", "CoordinationV1Api", "namespaced_lease")
SCALED_OBJECTS = Kind("keda.sh/v1alpha1", "scaledobjects", "ScaledObject")  # autoscaling.partner keda
SERVICE_ACCOUNTS = Kind("v1", "serviceaccounts", "ServiceAccount", "CoreV1Api", "namespaced_service_account")
ROLE_BINDINGS = Kind("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding", "RbacAuthorizationV1Api",
                     "namespaced_role_binding")  # the endpoint picker's, to the chart's ClusterRole
HPAS = Kind("autoscaling/v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", "AutoscalingV2Api",
            "namespaced_horizontal_pod_autoscaler")


class KubeError(Exception):
    """A non-2xx answer from the API server (``status`` 0: no answer: a timeout, a dropped
    connection). ``reason`` and ``message`` are the ``Status`` object's when the answer was one
    (``Forbidden``, ``Conflict``, ``Invalid``, ...), ``what`` the request's target
    (``deployments/<ns>/<name>``)."""

    def __init__(self, status: int, method: str, what: str, message: str, reason: str = "") -> None:
        code = f"HTTP {status}" + (f" {reason}" if reason else "") if status else (reason or "no answer")
        super().__init__(f"{method} {what}: {code}: {message}")
        self.status = status
        self.method = method
        self.what = what
        self.reason = reason
        self.message = message


def _error_from_answer(status: int, verb: str, what: str, raw: bytes) -> KubeError:
    """A KubeError from an error answer: the ``Status`` object's reason and message when it is one."""
    text = raw.decode(errors="replace")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    if isinstance(doc, dict) and doc.get("kind") == "Status":
        return KubeError(status, verb, what, str(doc.get("message") or "")[:500], str(doc.get("reason") or ""))
    return KubeError(status, verb, what, text[:500])


def _configuration(conn: kopf.ConnectionInfo, tmpdir: str) -> client.Configuration:
    """A client Configuration from kopf's credentials; CA/cert data go to files in ``tmpdir``."""

    def materialize(data: str | bytes | None, path: Any, name: str) -> str | None:
        if path:
            return os.fspath(path) if isinstance(path, (str, os.PathLike)) else path.decode()
        if not data:
            return None
        raw = data.encode() if isinstance(data, str) else data
        if b"-----BEGIN" not in raw:  # kubeconfig data is base64 of the PEM
            raw = base64.b64decode(raw)
        file = os.path.join(tmpdir, name)
        with open(os.open(file, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as fh:
            fh.write(raw)
        return file

    config = client.Configuration(host=conn.server.rstrip("/"))
    config.verify_ssl = not conn.insecure
    config.ssl_ca_cert = materialize(conn.ca_data, conn.ca_path, "ca.pem")
    config.cert_file = materialize(conn.certificate_data, conn.certificate_path, "cert.pem")
    config.key_file = materialize(conn.private_key_data, conn.private_key_path, "key.pem")
    config.proxy = conn.proxy_url
    config.client_side_validation = False  # the API server validates what we send
    return config


class KubeClient:
    """An async client bound to one API server; call ``close()`` when done."""

    def __init__(self, conn: kopf.ConnectionInfo, timeout_s: float = 30.0) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="inflight-kube-")
        self._api = client.ApiClient(_configuration(conn, self._tmp.name))
        for header, value in conn.as_http_headers().items():  # kopf's Authorization (token/basic)
            self._api.set_default_header(header, value)
        self._api.user_agent = "inflight-operator"
        self._timeout = timeout_s
        self._apis: dict[str, Any] = {}
        self._conn = conn
        self._watch_api: client.ApiClient | None = None  # watches hold a connection each: a pool of their own
        # Called after every successful write with (kind, namespace, name, the answer; None: deleted):
        # the watch-fed caches (``informer``) see the operator's own writes before their watch does.
        self.observers: list[Callable[[Kind, str, str, dict[str, Any] | None], None]] = []

    async def close(self) -> None:
        await self._api.close()
        if self._watch_api is not None:
            await self._watch_api.close()
        self._tmp.cleanup()

    def _method(self, verb: str, kind: Kind) -> tuple[Any, Any]:
        """The typed API object and the undecorated ``*_without_preload_content`` method for
        ``verb`` ("read", "list", "create", "patch", "patch_status", "patch_scale", "delete")."""
        if kind.api not in self._apis:
            self._apis[kind.api] = getattr(client, kind.api)(self._api)
        api = self._apis[kind.api]
        action, _, subresource = verb.partition("_")
        if kind.method:
            name = f"{action}_{kind.method}{'_' + subresource if subresource else ''}"
        else:
            action = "get" if action == "read" else action
            name = f"{action}_namespaced_custom_object{'_' + subresource if subresource else ''}"
        return api, getattr(type(api), f"{name}_without_preload_content").raw_function

    async def _call(self, verb: str, kind: Kind, namespace: str | None, name: str | None = None, **kwargs: Any) -> Any:
        """One API call built by the client's typed method; the answer as a JSON dict, errors as KubeError.

        Answers are read as JSON, not decoded into the client's models: a model decode drops
        fields newer than the client and refuses objects missing a field it calls required.
        ``namespace=None``: every namespace (a custom object list only).
        """
        kwargs["_request_timeout"] = self._timeout
        if namespace is None:
            api, _ = self._method("list", kind)
            method = type(api).list_cluster_custom_object_without_preload_content.raw_function
            args: list[Any] = [kind.group, kind.version, kind.plural]
        else:
            api, method = self._method(verb, kind)
            args = [name] if name is not None else []
            args = [*args, namespace] if kind.method else [kind.group, kind.version, namespace, kind.plural, *args]
        what = f"{kind.plural}/{namespace or '*'}/{name or ''}"
        try:
            resp = await method(api, *args, **kwargs)
            async with resp:
                raw = await resp.read()
        except ApiException as exc:  # raised before a response exists (e.g. a bad argument)
            raise KubeError(exc.status or 0, verb, what, str(exc.reason or exc)[:500]) from None
        except asyncio.TimeoutError as exc:
            raise KubeError(0, verb, what, f"no answer within {self._timeout:g} s", "Timeout") from exc
        except aiohttp.ClientError as exc:
            raise KubeError(0, verb, what, f"{type(exc).__name__}: {exc}"[:500], "ConnectionError") from exc
        if resp.status >= 400:
            raise _error_from_answer(resp.status, verb, what, raw)
        answer = json.loads(raw) if raw else {}
        if verb in ("create", "patch", "patch_status", "delete") and namespace is not None:
            obj = None if verb == "delete" else answer
            obj_name = name or ((answer.get("metadata") or {}).get("name") or "")
            for observe in self.observers:
                observe(kind, namespace, obj_name, obj)
        return answer

    async def list_versioned(self, kind: Kind, namespace: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        """Every object matching ``selector`` (a label selector string) and the list's resourceVersion."""
        data = await self._call("list", kind, namespace, label_selector=selector or None)
        return list(data.get("items") or []), str((data.get("metadata") or {}).get("resourceVersion") or "")

    async def watch(self, kind: Kind, namespace: str, selector: str, resource_version: str,
                    timeout_s: int) -> AsyncIterator[dict[str, Any]]:
        """The watch events (``{"type", "object"}``) from ``resource_version`` until the server ends
        the stream (after ``timeout_s``); an ``ERROR`` event (e.g. 410: the version expired) is raised
        as a KubeError."""
        if self._watch_api is None:
            config = _configuration(self._conn, self._tmp.name)
            config.connection_pool_maxsize = 0  # no limit: one long-lived connection per watch
            self._watch_api = client.ApiClient(config)
            for header, value in self._conn.as_http_headers().items():
                self._watch_api.set_default_header(header, value)
            self._watch_api.user_agent = "inflight-operator"
        api = getattr(client, kind.api)(self._watch_api)
        what = f"{kind.plural}/{namespace}/ (watch)"
        if kind.method:
            method = getattr(type(api), f"list_{kind.method}_without_preload_content").raw_function
            args: list[Any] = [namespace]
        else:
            method = type(api).list_namespaced_custom_object_without_preload_content.raw_function
            args = [kind.group, kind.version, namespace, kind.plural]
        timeout = aiohttp.ClientTimeout(total=timeout_s + 30, sock_connect=max(self._timeout, 10.0))
        try:
            resp = await method(api, *args, watch=True, label_selector=selector or None,
                                resource_version=resource_version or None, allow_watch_bookmarks=True,
                                timeout_seconds=timeout_s, _request_timeout=timeout)
        except ApiException as exc:
            raise KubeError(exc.status or 0, "watch", what, str(exc.reason or exc)[:500]) from None
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            raise KubeError(0, "watch", what, f"{type(exc).__name__}: {exc}"[:500], "ConnectionError") from exc
        async with resp:
            if resp.status >= 400:
                raise _error_from_answer(resp.status, "watch", what, await resp.read())
            try:
                while line := await resp.content.readline():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        status = event.get("object") or {}
                        raise KubeError(int(status.get("code") or 0), "watch", what,
                                        str(status.get("message") or ""), str(status.get("reason") or ""))
                    yield event
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                raise KubeError(0, "watch", what, f"{type(exc).__name__}: {exc}"[:500], "ConnectionError") from exc

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._call("read", kind, namespace, name)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: Kind, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects carrying all ``labels`` (also filtered here, the selector is advisory)."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        data = await self._call("list", kind, namespace, label_selector=selector)
        return [
            obj for obj in data.get("items") or []
            if all(((obj.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    async def list_all(self, kind: Kind, namespace: str | None) -> list[dict[str, Any]]:
        """Every custom object of ``kind`` in ``namespace`` (``None``: in every namespace)."""
        data = await self._call("list", kind, namespace)
        return list(data.get("items") or [])

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call("create", kind, namespace, body=body)

    async def patch(
        self, kind: Kind, namespace: str, name: str, body: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        """JSON merge patch (RFC 7386) of the object or its ``status``/``scale`` subresource."""
        verb = "patch" if subresource is None else f"patch_{subresource}"
        return await self._call(verb, kind, namespace, name, body=body, _content_type=MERGE_PATCH)

    async def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        """Delete (background propagation); ``False`` when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            await self._call("delete", kind, namespace, name, body=body)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def apply(
        self, kind: Kind, namespace: str, body: dict[str, Any], patch_body: dict[str, Any] | None = None,
        existing: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Create, or merge-patch what exists with ``patch_body`` (default: ``body``) plus the
        deletion of every key the last apply set and this one does not (``applied``).
        ``existing``: the object as a watch-fed cache holds it, patched at once (no create first)."""
        patch = patch_body if patch_body is not None else body
        created = copy.deepcopy(body)
        created["metadata"].setdefault("annotations", {})[applied.ANNOTATION] = applied.record(patch)
        name = body["metadata"]["name"]
        if existing is not None:
            try:
                return await self.patch(
                    kind, namespace, name, applied.with_deletions(patch, applied.last_applied(existing)))
            except KubeError as exc:
                if exc.status != 404:  # gone since the cache saw it: created below
                    raise
        for _ in range(3):  # an object deleted between our create and our patch is created again
            try:
                return await self.create(kind, namespace, created)
            except KubeError as exc:
                if exc.status != 409:
                    raise
            existing = await self.get(kind, namespace, name)
            if existing is None:
                continue
            try:
                return await self.patch(
                    kind, namespace, name, applied.with_deletions(patch, applied.last_applied(existing)))
            except KubeError as exc:
                if exc.status != 404:
                    raise
        raise KubeError(409, "apply", f"{kind.plural}/{namespace}/{name}",
                        "the object was deleted and re-created by someone else three times during the apply",
                        "Conflict")

    async def create_if_missing(self, kind: Kind, namespace: str, body: dict[str, Any]) -> bool:
        """Create ``body`` unless an object of that name exists (never changes it); True if created."""
        if await self.get(kind, namespace, body["metadata"]["name"]) is not None:
            return False
        try:
            await self.create(kind, namespace, body)
        except KubeError as exc:
            if exc.status == 409:  # created meanwhile by someone else: keep theirs
                return False
            raise
        return True

    async def post_event(self, involved: dict[str, Any], event_type: str, reason: str, message: str) -> None:
        """A core/v1 Event about ``involved`` (an object with apiVersion/kind/metadata)."""
        meta = involved["metadata"]
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": involved["apiVersion"], "kind": involved["kind"], "name": meta["name"],
                "namespace": meta["namespace"], "uid": meta.get("uid", ""),
            },
            "type": event_type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "inflight-operator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": "inflight-operator",
        }
        await self.create(EVENTS, meta["namespace"], body)
