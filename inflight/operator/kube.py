"""All of the operator's own Kubernetes API I/O: a small async client over aiohttp.

Owns: URLs of the kinds the operator touches, authentication from a ``kopf.ConnectionInfo``
(the same credentials kopf logged in with, with kopf's own SSL and
header handling), get/list/create/patch/delete, create-or-patch
(a 409 on create is not an error: the object is merge-patched), Events, and reading the API
key Secret. Writes are JSON merge patches only (no server-side apply), so the same code works
against a real API server and the kmock emulator. Knows nothing about what it writes.
"""

from __future__ import annotations

import base64
import datetime
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True, slots=True)
class Kind:
    api_version: str  # "v1", "apps/v1", ...
    plural: str
    kind: str

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        url = f"{root}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            url += f"/{name}"
        if subresource is not None:
            url += f"/{subresource}"
        return url


INFERENCE_DEPLOYMENTS = Kind("inflight.dev/v1alpha1", "inferencedeployments", "InferenceDeployment")
DEPLOYMENTS = Kind("apps/v1", "deployments", "Deployment")
SERVICES = Kind("v1", "services", "Service")
PDBS = Kind("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget")
CONFIGMAPS = Kind("v1", "configmaps", "ConfigMap")
PODS = Kind("v1", "pods", "Pod")
SECRETS = Kind("v1", "secrets", "Secret")
EVENTS = Kind("v1", "events", "Event")


class KubeError(Exception):
    """A non-2xx answer from the API server."""

    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


class KubeClient:
    """An async client bound to one API server; call ``close()`` when done."""

    def __init__(self, conn: kopf.ConnectionInfo, timeout_s: float = 30.0) -> None:
        self._conn = conn
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._conn.as_ssl_context())  # kopf's CA/cert handling
            self._session = aiohttp.ClientSession(
                base_url=self._conn.server.rstrip("/") + "/",
                headers=self._conn.as_http_headers(),
                connector=connector,
                timeout=self._timeout,
            )
        return self._session

    async def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        async with self._http().request(method, path.lstrip("/"), **kwargs) as resp:
            if resp.status >= 400:
                raise KubeError(resp.status, method, path, (await resp.text())[:500])
            return await resp.json(content_type=None) or {}

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return await self._request("GET", kind.path(namespace, name))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, kind: Kind, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects carrying all ``labels`` (also filtered here, the selector is advisory)."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        data = await self._request("GET", kind.path(namespace), params={"labelSelector": selector})
        items = data.get("items") or []
        return [
            obj for obj in items
            if all((obj.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    async def create(self, kind: Kind, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._request("POST", kind.path(namespace), json=body)

    async def patch(
        self, kind: Kind, namespace: str, name: str, body: dict[str, Any], subresource: str | None = None
    ) -> dict[str, Any]:
        """JSON merge patch (RFC 7386)."""
        return await self._request(
            "PATCH", kind.path(namespace, name, subresource), json=body, headers={"Content-Type": MERGE_PATCH}
        )

    async def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        """Delete (background propagation); ``False`` when it was already gone."""
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            await self._request("DELETE", kind.path(namespace, name), json=body)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def apply(
        self, kind: Kind, namespace: str, body: dict[str, Any], patch_body: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Create, or merge-patch what exists with ``patch_body`` (default: ``body``)."""
        try:
            return await self.create(kind, namespace, body)
        except KubeError as exc:
            if exc.status != 409:
                raise
        name = body["metadata"]["name"]
        return await self.patch(kind, namespace, name, patch_body if patch_body is not None else body)

    async def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        """A Secret's value (base64-decoded), or ``None`` when the Secret or key is missing."""
        secret = await self.get(SECRETS, namespace, name)
        raw = ((secret or {}).get("data") or {}).get(key)
        return base64.b64decode(raw).decode() if raw else None

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
