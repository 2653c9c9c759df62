"""Pure builders for how LoRA adapters' files reach the runtime pods, and the readiness gate.

Owns the pod-template parts of ``spec.adapters``: one read-only volume per adapter PVC (mounted
at ``/adapters/pvc/<claimName>``), the per-pod ``adapters-local`` emptyDir (at
``/adapters/local``) that hf adapters (without a shared model cache) and image adapters are
copied into, their init containers (``model_fetch`` for hf, as the model's hf source is
fetched; a ``cp`` for an image), and the readiness gate ``inflight.dev/adapters-loaded`` that
keeps a new or restarted pod out of the Service until the operator has loaded every adapter
into it (``adapters``). The adapter *list* is not in the template (no ``--lora-modules``): a
pvc adapter added on a claim already mounted changes nothing here, so nothing rolls.
Knows nothing about I/O.
"""

from __future__ import annotations

import hashlib
from typing import Any

from inflight.operator.adapter_source import (
    ADAPTER_HF_PATTERNS,
    ADAPTERS_MOUNT,
    Adapter,
    adapter_path,
    hf_in_model_cache,
    pvc_volume_name,
)
from inflight.operator.model_source import ModelSource
from inflight.operator.render_model import CONTAINER_SECURITY, HF_HOME, MODEL_MOUNT

READINESS_GATE = "inflight.dev/adapters-loaded"
LOCAL_VOLUME = "adapters-local"
LOCAL_MOUNT = f"{ADAPTERS_MOUNT}/local"
ADAPTER_MARKER_FILE = "adapter_config.json"


def readiness_gates(lora: bool) -> list[dict[str, str]]:
    """The pod's readiness gates: the adapters' one whenever the pods run with LoRA on (also with
    no adapter listed yet, so that adding the first one does not change the template)."""
    return [{"conditionType": READINESS_GATE}] if lora else []


def _claims(adapters: tuple[Adapter, ...]) -> list[str]:
    return sorted({a.pvc.claim_name for a in adapters if a.pvc is not None})


def _needs_local(adapters: tuple[Adapter, ...], model: ModelSource) -> bool:
    return any(a.image is not None or (a.hf is not None and not hf_in_model_cache(model)) for a in adapters)


def volumes(adapters: tuple[Adapter, ...], model: ModelSource) -> list[dict[str, Any]]:
    vols: list[dict[str, Any]] = [
        {"name": pvc_volume_name(c), "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
        for c in _claims(adapters)
    ]
    if _needs_local(adapters, model):
        vols.append({"name": LOCAL_VOLUME, "emptyDir": {}})
    if model.hf is None and any(a.hf is not None for a in adapters):
        vols.append({"name": "hf-home", "emptyDir": {}})  # the model's hf source adds it otherwise
    return vols


def mounts(adapters: tuple[Adapter, ...], model: ModelSource) -> list[dict[str, Any]]:
    """The runtime container's (read-only) adapter mounts."""
    found = [{"name": pvc_volume_name(c), "mountPath": f"{ADAPTERS_MOUNT}/pvc/{c}", "readOnly": True}
             for c in _claims(adapters)]
    if _needs_local(adapters, model):
        found.append({"name": LOCAL_VOLUME, "mountPath": LOCAL_MOUNT, "readOnly": True})
    return found


def container_name(adapter: Adapter) -> str:
    """``adapter-<name>``, cut to a DNS label with a digest when the name is long."""
    name = f"adapter-{adapter.name}"
    if len(name) <= 63:
        return name
    return f"adapter-{adapter.name[:45].rstrip('-')}-{hashlib.sha256(adapter.name.encode()).hexdigest()[:8]}"


def init_containers(adapters: tuple[Adapter, ...], model: ModelSource, runtime_image: str) -> list[dict[str, Any]]:
    """One init container per hf or image adapter, after the model's own."""
    found: list[dict[str, Any]] = []
    for adapter in adapters:
        dest = adapter_path(adapter, model)
        if adapter.image is not None:
            src = adapter.image.path.rstrip("/") or "/"
            found.append({
                "name": container_name(adapter),
                "image": adapter.image.reference,
                "command": ["sh", "-c", f'mkdir -p "{dest}" && cp -a "{src}/." "{dest}/"'],
                "volumeMounts": [{"name": LOCAL_VOLUME, "mountPath": LOCAL_MOUNT}],
                "securityContext": dict(CONTAINER_SECURITY),
            })
        elif adapter.hf is not None:
            found.append(_fetch_container(adapter, model, dest, runtime_image))
    return found


def _fetch_container(adapter: Adapter, model: ModelSource, dest: str, runtime_image: str) -> dict[str, Any]:
    hf = adapter.hf
    assert hf is not None
    cmd = ["python", "-m", "inflight.operator.model_fetch", "--repo-id", hf.repo, "--revision", hf.revision,
           "--dest", dest, "--expect-file", ADAPTER_MARKER_FILE]
    for pattern in ADAPTER_HF_PATTERNS:
        cmd += ["--allow-pattern", pattern]
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": "HF_HUB_OFFLINE", "value": "0"},
    ]
    if model.hf is not None and model.hf.endpoint is not None:  # the model's mirror serves its adapters too
        env.append({"name": "HF_ENDPOINT", "value": model.hf.endpoint})
    if hf.token is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": hf.token.name, "key": hf.token.key}}})
    volume = ({"name": "model", "mountPath": MODEL_MOUNT} if hf_in_model_cache(model)
              else {"name": LOCAL_VOLUME, "mountPath": LOCAL_MOUNT})
    return {
        "name": container_name(adapter),
        "image": (model.hf.image if model.hf is not None else None) or runtime_image,
        "command": cmd,
        "env": env,
        "volumeMounts": [volume, {"name": "hf-home", "mountPath": HF_HOME}],
        "securityContext": dict(CONTAINER_SECURITY),
    }
