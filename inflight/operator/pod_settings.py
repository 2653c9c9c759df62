"""Pod settings an SRE passes through to the runtime pods, parsed and checked against what the
operator itself renders.

Owns ``PodSettings`` (imagePullSecrets, env, envFrom, volumes, volumeMounts,
runtimeClassName, pod annotations and labels, shared-memory size, GPU resource name) and
``Rollout`` (RollingUpdate surge settings or Recreate) and ``DisruptionBudget`` (the PDB's
``maxUnavailable``). The checks here are the ones the
API server cannot make because they depend on the operator: names and paths the operator
already uses (volumes ``model``, ``dshm``; mounts at ``/models`` and ``/dev/shm``; env vars it
sets; selector labels). The content of an env var or a volume source is the API server's to
validate: a rejected Deployment becomes a ``Degraded`` condition. Knows nothing about I/O.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from inflight.operator import fields

RESERVED_VOLUMES = ("model", "dshm", "hf-home", "kernel-cache")
RESERVED_MOUNTS = ("/models", "/dev/shm", "/var/cache/inflight")
RESERVED_ENV = ("INFLIGHT_API_KEY", "INFLIGHT_ADMIN_API_KEY", "HF_TOKEN")
RESERVED_ENV_PREFIX = "INFLIGHT_LIVE_"
RESERVED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by")
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
ROLLOUT_TYPES = ("RollingUpdate", "Recreate")


@dataclass(frozen=True, slots=True)
class Rollout:
    type: str = "RollingUpdate"
    max_surge: int | str = 1
    max_unavailable: int | str = 0


@dataclass(frozen=True, slots=True)
class DisruptionBudget:
    """The PodDisruptionBudget's ``maxUnavailable``: pods a node drain may evict at once."""

    max_unavailable: int | str = 1


@dataclass(frozen=True, slots=True)
class PodSettings:
    image_pull_secrets: tuple[str, ...] = ()
    env: tuple[dict[str, Any], ...] = ()
    env_from: tuple[dict[str, Any], ...] = ()
    volumes: tuple[dict[str, Any], ...] = ()
    volume_mounts: tuple[dict[str, Any], ...] = ()
    runtime_class_name: str | None = None
    annotations: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    shm_size: str | None = None
    gpu_resource_name: str = DEFAULT_GPU_RESOURCE


def parse_pod_settings(spec: dict[str, Any], resources: dict[str, Any]) -> PodSettings:
    p = "spec"
    volumes = tuple(copy.deepcopy(v) for v in fields.list_of_obj(spec, "volumes", p))
    volume_names = _volume_names(volumes)
    runtime_class = fields.optional_string(spec, "runtimeClassName", p)
    if runtime_class is not None:
        fields.matching(runtime_class, fields.DNS_SUBDOMAIN, "spec.runtimeClassName", "nvidia")
    gpu_name = fields.string(resources, "gpuResourceName", DEFAULT_GPU_RESOURCE, "spec.resources")
    fields.matching(gpu_name, fields.RESOURCE_NAME, "spec.resources.gpuResourceName",
                    "nvidia.com/gpu, nvidia.com/mig-1g.10gb, amd.com/gpu")
    labels = fields.string_map(spec, "podLabels", p)
    taken = sorted(set(labels) & set(RESERVED_LABELS))
    if taken:
        raise ValueError(f"spec.podLabels must not set {', '.join(taken)} (the operator's selector labels).")
    return PodSettings(
        image_pull_secrets=_pull_secrets(spec),
        env=_env(spec),
        env_from=_env_from(spec),
        volumes=volumes,
        volume_mounts=_mounts(spec, volume_names),
        runtime_class_name=runtime_class,
        annotations=fields.string_map(spec, "podAnnotations", p),
        labels=labels,
        shm_size=fields.quantity(resources, "shmSize", "spec.resources"),
        gpu_resource_name=gpu_name,
    )


def _pull_secrets(spec: dict[str, Any]) -> tuple[str, ...]:
    names = []
    for i, ref in enumerate(fields.list_of_obj(spec, "imagePullSecrets", "spec")):
        name = fields.string(ref, "name", None, f"spec.imagePullSecrets[{i}]")
        names.append(fields.matching(name, fields.DNS_SUBDOMAIN, f"spec.imagePullSecrets[{i}].name", "regcred"))
    return tuple(names)


def _env(spec: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    seen: set[str] = set()
    for i, var in enumerate(fields.list_of_obj(spec, "env", "spec")):
        name = fields.matching(fields.string(var, "name", None, f"spec.env[{i}]"), fields.ENV_NAME,
                               f"spec.env[{i}].name", "HF_HUB_OFFLINE")
        if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(f"spec.env[{i}].name {name!r} is set by the operator; use the matching CR field.")
        if name in seen:
            raise ValueError(f"spec.env has {name!r} twice.")
        seen.add(name)
        if "value" in var and not isinstance(var["value"], str):
            raise ValueError(f"spec.env[{i}].value must be a string (quote numbers: '1').")
    return tuple(copy.deepcopy(v) for v in spec.get("env") or [])


def _env_from(spec: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    items = fields.list_of_obj(spec, "envFrom", "spec")
    for i, src in enumerate(items):
        if len([k for k in ("configMapRef", "secretRef") if src.get(k) is not None]) != 1:
            raise ValueError(f"spec.envFrom[{i}] needs exactly one of configMapRef, secretRef.")
    return tuple(copy.deepcopy(v) for v in items)


def _volume_names(volumes: tuple[dict[str, Any], ...]) -> set[str]:
    names: set[str] = set()
    for i, vol in enumerate(volumes):
        name = fields.matching(fields.string(vol, "name", None, f"spec.volumes[{i}]"), fields.DNS_LABEL,
                               f"spec.volumes[{i}].name", "scratch")
        if name in RESERVED_VOLUMES:
            raise ValueError(f"spec.volumes[{i}].name {name!r} is used by the operator; pick another name.")
        if name in names:
            raise ValueError(f"spec.volumes has {name!r} twice.")
        names.add(name)
    return names


def _mounts(spec: dict[str, Any], volume_names: set[str]) -> tuple[dict[str, Any], ...]:
    items = fields.list_of_obj(spec, "volumeMounts", "spec")
    for i, mount in enumerate(items):
        p = f"spec.volumeMounts[{i}]"
        name = fields.string(mount, "name", None, p)
        if name not in volume_names:
            raise ValueError(f"{p}.name {name!r} is not in spec.volumes ({', '.join(sorted(volume_names)) or 'none'}).")
        path = fields.string(mount, "mountPath", None, p).rstrip("/") or "/"
        if not path.startswith("/"):
            raise ValueError(f"{p}.mountPath must be absolute (got {path!r}).")
        if any(path == r or path.startswith(r + "/") for r in RESERVED_MOUNTS):
            raise ValueError(f"{p}.mountPath {path!r} is inside {', '.join(RESERVED_MOUNTS)} (the operator's mounts).")
    return tuple(copy.deepcopy(m) for m in items)


def parse_rollout(raw: dict[str, Any]) -> Rollout:
    p, d = "spec.rollout", Rollout()
    kind = fields.string(raw, "strategy", d.type, p)
    if kind not in ROLLOUT_TYPES:
        raise ValueError(f"{p}.strategy must be one of {', '.join(ROLLOUT_TYPES)} (got {kind!r}).")
    if kind == "Recreate":
        if "maxSurge" in raw or "maxUnavailable" in raw:
            raise ValueError(f"{p}.maxSurge/maxUnavailable apply to RollingUpdate only (strategy is Recreate).")
        return Rollout(type="Recreate")
    surge = fields.int_or_percent(raw, "maxSurge", d.max_surge, p)
    unavailable = fields.int_or_percent(raw, "maxUnavailable", d.max_unavailable, p)
    if not fields.positive_or_zero(surge) and not fields.positive_or_zero(unavailable):
        raise ValueError(f"{p}: maxSurge and maxUnavailable cannot both be 0 (the rollout could never move).")
    return Rollout(type="RollingUpdate", max_surge=surge, max_unavailable=unavailable)


def parse_disruption_budget(raw: dict[str, Any]) -> DisruptionBudget:
    p, d = "spec.disruptionBudget", DisruptionBudget()
    unknown = sorted(set(raw) - {"maxUnavailable"})
    if unknown:
        raise ValueError(f"{p} has unknown keys {', '.join(unknown)} (maxUnavailable).")
    value = fields.int_or_percent(raw, "maxUnavailable", d.max_unavailable, p)
    if not fields.positive_or_zero(value):
        raise ValueError(f"{p}.maxUnavailable must be above 0: 0 blocks every node drain and cluster upgrade "
                         "(the drain waits for ever). Use 1 (the default) or a percentage like '25%'.")
    return DisruptionBudget(max_unavailable=value)
