"""The runtime pods' admin keys, derived so the operator never reads a Secret outside its own
namespace.

Owns the scheme: one random root key in a Secret of the operator's namespace
(``INFLIGHT_OPERATOR_ROOT_SECRET``, created on first use, readable through a Role limited to
that one name), and for each InferenceDeployment the key HMAC-SHA256(root,
``inflight-admin/v1/<namespace>/<name>``), which the operator writes into ``<name>-admin`` (it
may create and delete Secrets cluster-wide, never read them) and presents on its
``/admin/config`` pushes. A key id (a hash of the root) goes on the pod template, so pods roll
when the root key changes and the ``<name>-admin`` of an older scheme is replaced once.
Knows nothing about reconciling.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from typing import Any

from inflight.operator.kube import SECRETS, KubeClient, KubeError

ROOT_KEY = "root-key"
SCHEME = "inflight-admin/v1"


def derive(root: bytes, namespace: str, name: str) -> str:
    """The admin key of ``namespace/name`` (URL-safe base64, 43 characters)."""
    digest = hmac.new(root, f"{SCHEME}/{namespace}/{name}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def key_id(root: bytes) -> str:
    """A short public fingerprint of the root key (it reveals nothing about it)."""
    return hashlib.sha256(b"key-id:" + root).hexdigest()[:12]


async def load_or_create_root(kube: KubeClient, namespace: str, name: str) -> bytes:
    """The root key from its Secret, created with 32 random bytes when missing."""
    for _ in range(3):
        secret = await kube.get(SECRETS, namespace, name)
        raw = ((secret or {}).get("data") or {}).get(ROOT_KEY)
        if raw:
            return base64.b64decode(raw)
        body: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": "inflight-operator"}},
            "data": {ROOT_KEY: base64.b64encode(secrets.token_bytes(32)).decode()},
        }
        try:
            await kube.create(SECRETS, namespace, body)
        except KubeError as exc:
            if exc.status != 409:  # 409: another replica created it first; read theirs
                raise
    raise KubeError(0, "get", f"secrets/{namespace}/{name}", "the root key Secret has no root-key entry")
