"""Pure builders for how the weights reach the runtime container, per model source.

Owns: the ``model`` volume (PVC read-only, hostPath, an emptyDir filled by an init container,
or the model cache), the init containers (``model-loader`` copies an image's weights,
``model-fetch`` downloads an ``hf`` repo with huggingface_hub into the cache), the cache PVC
the operator creates (``<name>-model-cache``), the ``--model`` path the runtime is given,
and the cache state reported in ``status.modelCache`` (read from the pods' init container
statuses). Knows nothing about I/O.
"""

from __future__ import annotations

from typing import Any

from inflight.operator.model_source import ModelSource, hf_cache_subdir

MODEL_MOUNT = "/models"
HF_HOME = "/tmp/hf-home"
FETCH_CONTAINER = "model-fetch"
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def cache_claim_name(name: str, model: ModelSource) -> str | None:
    """The PVC the hf source downloads into, or ``None`` for a per-pod emptyDir."""
    if model.cache is None or not model.cache.shared:
        return None
    return model.cache.claim_name or f"{name}-model-cache"


def model_path(model: ModelSource) -> str:
    """Where the runtime container finds config.json and the weights."""
    if model.hf is not None:
        return f"{MODEL_MOUNT}/{hf_cache_subdir(model.hf)}"
    if model.image or not model.path:
        return MODEL_MOUNT
    return f"{MODEL_MOUNT}/{model.path.strip('/')}"


def model_volume(name: str, model: ModelSource, size_limit: str | None = None) -> dict[str, Any]:
    """The ``model`` volume; a per-pod emptyDir is capped at ``size_limit``
    (``spec.resources.ephemeralStorage``) when one is given."""
    if model.pvc_claim_name:
        return {"name": "model", "persistentVolumeClaim": {"claimName": model.pvc_claim_name, "readOnly": True}}
    if model.host_path:
        return {"name": "model", "hostPath": {"path": model.host_path, "type": "Directory"}}
    if (claim := cache_claim_name(name, model)) is not None:
        return {"name": "model", "persistentVolumeClaim": {"claimName": claim}}
    return {"name": "model", "emptyDir": {"sizeLimit": size_limit} if size_limit else {}}


def extra_volumes(model: ModelSource) -> list[dict[str, Any]]:
    """huggingface_hub's own scratch space (locks, metadata) for the fetch container."""
    return [{"name": "hf-home", "emptyDir": {}}] if model.hf is not None else []


def runtime_mount(model: ModelSource) -> dict[str, Any]:
    """Read-only except for an image source's emptyDir (kept as it was: no rollout on upgrade)."""
    return {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": not model.image}


def fetch_command(model: ModelSource) -> list[str]:
    """The ``model-fetch`` init container's command (runs in the runtime image)."""
    hf = model.hf
    if hf is None:
        raise ValueError("fetch_command needs an hf model source.")
    cmd = ["python", "-m", "inflight.operator.model_fetch", "--repo-id", hf.repo_id, "--revision", hf.revision,
           "--dest", model_path(model)]
    for pattern in hf.allow_patterns:
        cmd += ["--allow-pattern", pattern]
    return cmd


def init_containers(model: ModelSource, runtime_image: str) -> list[dict[str, Any]]:
    if model.image:
        src = model.path.rstrip("/") or "/"
        return [{
            "name": "model-loader",
            "image": model.image,
            "command": ["sh", "-c", f'cp -a "{src}/." {MODEL_MOUNT}/'],
            "volumeMounts": [{"name": "model", "mountPath": MODEL_MOUNT}],
            "securityContext": dict(CONTAINER_SECURITY),
        }]
    if model.hf is None:
        return []
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": "HF_HUB_OFFLINE", "value": "0"},  # the runtime image sets 1 (its server never downloads)
    ]
    if model.hf.endpoint is not None:
        env.append({"name": "HF_ENDPOINT", "value": model.hf.endpoint})
    if model.hf.token is not None:
        ref = model.hf.token
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    return [{
        "name": FETCH_CONTAINER,
        "image": model.hf.image or runtime_image,
        "command": fetch_command(model),
        "env": env,
        "volumeMounts": [
            {"name": "model", "mountPath": MODEL_MOUNT},
            {"name": "hf-home", "mountPath": HF_HOME},
        ],
        "securityContext": dict(CONTAINER_SECURITY),
    }]


def render_cache_pvc(name: str, model: ModelSource, metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The cache PVC the operator creates (``cache.size``), or ``None``."""
    cache = model.cache
    if cache is None or cache.size is None:
        return None
    meta = dict(metadata)
    meta["name"] = f"{name}-model-cache"
    spec: dict[str, Any] = {
        "accessModes": [cache.access_mode],
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name is not None:
        spec["storageClassName"] = cache.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec}


def cache_status(name: str, model: ModelSource, pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    """``status.modelCache`` from the pods' ``model-fetch`` init containers; ``None`` without hf."""
    if model.hf is None:
        return None
    claim = cache_claim_name(name, model)
    states = [_fetch_state(p) for p in pods]
    if "Ready" in states:
        state, message = "Ready", f"{model.hf.repo_id}@{model.hf.revision} is in the cache"
    elif failed := [s for s in states if s.startswith("Failed")]:
        state, message = "Failed", failed[0].partition(": ")[2] or "the download failed; see the init container log"
    elif "Downloading" in states:
        state, message = "Downloading", f"downloading {model.hf.repo_id}@{model.hf.revision}"
    else:
        state, message = "Pending", "no pod has started the download yet"
    return {
        "state": state,
        "volume": f"pvc/{claim}" if claim else "emptyDir (per pod: every pod downloads)",
        "path": model_path(model),
        "message": message,
    }


def _fetch_state(pod: dict[str, Any]) -> str:
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") != FETCH_CONTAINER:
            continue
        state = cs.get("state") or {}
        if "terminated" in state:
            term = state["terminated"] or {}
            if term.get("exitCode") == 0:
                return "Ready"
            return f"Failed: exit {term.get('exitCode')}: {(term.get('message') or term.get('reason') or '')[:200]}"
        if "running" in state:
            return "Downloading"
        waiting = (state.get("waiting") or {}).get("reason", "")
        if waiting in ("CrashLoopBackOff", "Error") or (cs.get("lastState") or {}).get("terminated"):
            return f"Failed: {waiting or 'restarted after an error'}"
    return "Pending"
