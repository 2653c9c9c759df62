"""``python -m inflight.operator.crd_upgrade``: what the chart's pre-upgrade hook runs, so that
``helm upgrade`` upgrades the InferenceDeployment CRD (Helm installs ``crds/`` once and never
upgrades it: the API server would go on pruning every field the new chart added).

Owns the one step: a server-side apply (``application/apply-patch+yaml``, field manager
``inflight-chart``, ``force``: the chart owns the CRD's spec) of the CRD file the chart ships
(mounted from the hook's ConfigMap), then a read-back that the stored CRD serves every version
the file declares, with the file's storage version. A server-side apply changes only the CRD:
existing InferenceDeployments, their specs and status are untouched, and fields the old schema
pruned on write are not restored (they were never stored). It refuses a file whose CRD is not
the InferenceDeployment one and a downgrade that would drop a served version the cluster
stores objects in. Knows nothing about reconciling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

import yaml
from kubernetes.aio import client, config
from kubernetes.aio.client.exceptions import ApiException

from inflight.operator.crd import API_GROUP, PLURAL

FIELD_MANAGER = "inflight-chart"
APPLY_PATCH = "application/apply-patch+yaml"
CRD_NAME = f"{PLURAL}.{API_GROUP}"
logger = logging.getLogger("inflight.operator.crd_upgrade")


class UpgradeError(RuntimeError):
    """The CRD could not be upgraded; the message says why (the hook Job fails with it)."""


def load_crd(path: Path) -> dict[str, Any]:
    """The CRD document of ``path``, checked to be the InferenceDeployment CRD."""
    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
        raise UpgradeError(f"{path} holds no CustomResourceDefinition")
    if (doc.get("metadata") or {}).get("name") != CRD_NAME:
        raise UpgradeError(f"{path} is the CRD {doc.get('metadata', {}).get('name')!r}, not {CRD_NAME}")
    return doc


def _versions(crd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in (crd.get("spec") or {}).get("versions") or []}


def check_compatible(stored: dict[str, Any] | None, new: dict[str, Any]) -> None:
    """Refuse an apply that would stop serving a version the cluster stores objects in
    (``status.storedVersions``): those objects would become unreadable until migrated."""
    if stored is None:
        return
    kept = set(_versions(new))
    lost = [v for v in (stored.get("status") or {}).get("storedVersions") or [] if v not in kept]
    if lost:
        raise UpgradeError(f"the new CRD drops version(s) {', '.join(lost)} that objects are stored in "
                           "(status.storedVersions); migrate them first (docs/kubernetes.md, Upgrades)")


async def _call(api: client.ApiextensionsV1Api, method: str, *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """One call, the answer as a JSON dict (``None`` on 404); the client's models are bypassed
    (as in ``kube``) so no schema field newer than the client is lost."""
    fn = getattr(type(api), f"{method}_without_preload_content").raw_function
    try:
        resp = await fn(api, *args, _request_timeout=30, **kwargs)
        async with resp:
            raw = await resp.read()
    except ApiException as exc:
        raise UpgradeError(f"{method} {CRD_NAME}: {exc.status} {exc.reason}") from None
    if resp.status == 404:
        return None
    if resp.status >= 400:
        raise UpgradeError(f"{method} {CRD_NAME}: {resp.status} {raw.decode(errors='replace')[:500]}")
    return json.loads(raw) if raw else {}


async def apply_crd(api_client: client.ApiClient, crd: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply ``crd``; the CRD as stored afterwards."""
    api = client.ApiextensionsV1Api(api_client)
    check_compatible(await _call(api, "read_custom_resource_definition", CRD_NAME), crd)
    await _call(api, "patch_custom_resource_definition", CRD_NAME, crd, field_manager=FIELD_MANAGER,
                force=True, _content_type=APPLY_PATCH)
    stored = await _call(api, "read_custom_resource_definition", CRD_NAME)
    if stored is None:
        raise UpgradeError(f"{CRD_NAME} is gone after the apply")
    want, got = _versions(crd), _versions(stored)
    for name, version in want.items():
        if name not in got or got[name].get("schema") != version.get("schema"):
            raise UpgradeError(f"{CRD_NAME} version {name} does not serve the applied schema")
        if bool(got[name].get("storage")) != bool(version.get("storage")):
            raise UpgradeError(f"{CRD_NAME} version {name}: storage is not what the chart sets")
    return stored


async def _client() -> client.ApiClient:
    try:
        config.load_incluster_config()  # the hook Job's ServiceAccount
    except config.ConfigException:
        await config.load_kube_config()  # run by hand, e.g. the documented manual step
    return client.ApiClient()


async def _run(path: Path) -> dict[str, Any]:
    crd = load_crd(path)
    api_client = await _client()
    try:
        return await apply_crd(api_client, crd)
    finally:
        await api_client.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inflight.operator.crd_upgrade", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", type=Path, required=True, help="the CRD YAML (the chart's crds/ file)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        stored = asyncio.run(_run(args.file))
    except UpgradeError as exc:
        print(f"CRD upgrade failed: {exc}", file=sys.stderr)
        return 1
    versions = ", ".join(f"{v['name']}{' (storage)' if v.get('storage') else ''}" for v in stored["spec"]["versions"])
    print(f"applied {CRD_NAME} (server-side, field manager {FIELD_MANAGER}): {versions}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
