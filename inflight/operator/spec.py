"""Typed InferenceDeployment spec: frozen dataclasses parsed and validated from the CR dict.

Owns: the shape of ``spec`` as Python values, the operator-side defaults that are not
engine knobs (engine defaults live in EngineConfig only), and the validation a CR must
pass before anything is rendered (``parse_spec`` raises ``ValueError`` with a message
naming the field). Knows nothing about Kubernetes I/O or manifests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inflight.operator import engine_args

RUNTIME_IMAGE = "ghcr.io/inflight-dev/inflight-runtime:0.1.0"
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where the weights come from: exactly one of pvc, host_path, image."""

    served_model_name: str
    pvc_claim_name: str | None = None
    host_path: str | None = None
    image: str | None = None
    path: str = ""  # inside the volume / the image


@dataclass(frozen=True, slots=True)
class Resources:
    gpus: int = 1
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True, slots=True)
class Autoscaling:
    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_kv_cache_usage: float = 0.8
    target_queue_depth: float = 4.0
    scale_up_stabilization_seconds: float = 0.0
    scale_down_stabilization_seconds: float = 300.0
    interval_seconds: float = 15.0


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    type: str = "ClusterIP"
    port: int = 8000


@dataclass(frozen=True, slots=True)
class SecretRef:
    name: str
    key: str = "api-key"


@dataclass(frozen=True, slots=True)
class InferenceSpec:
    """The whole validated spec; ``engine`` holds snake_case EngineConfig values that were set."""

    name: str
    namespace: str
    model: ModelSource
    engine: dict[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    image: str = RUNTIME_IMAGE
    resources: Resources = Resources()
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    priority_class_name: str | None = None
    replicas: int = 1
    autoscaling: Autoscaling = Autoscaling()
    service: ServiceSpec = ServiceSpec()
    api_key_secret_ref: SecretRef | None = None
    drain_timeout_seconds: int = 30


def parse_spec(name: str, namespace: str, spec: dict[str, Any]) -> InferenceSpec:
    """Validate a CR ``spec`` dict into an InferenceSpec; raise ``ValueError`` naming the field."""
    if not isinstance(spec, dict):
        raise ValueError("spec must be an object.")
    engine_raw = dict(_obj(spec, "engine"))
    extra_args = engine_raw.pop("extraArgs", None) or []
    if not isinstance(extra_args, list) or not all(isinstance(a, str) for a in extra_args):
        raise ValueError("spec.engine.extraArgs must be a list of strings.")
    replicas = _int(spec, "replicas", 1, minimum=0)
    return InferenceSpec(
        name=name,
        namespace=namespace,
        model=_parse_model(name, _obj(spec, "model", required=True)),
        engine=engine_args.parse_engine(engine_raw),
        extra_args=tuple(extra_args),
        image=_str(spec, "image", RUNTIME_IMAGE),
        resources=_parse_resources(_obj(spec, "resources")),
        node_selector={str(k): str(v) for k, v in _obj(spec, "nodeSelector").items()},
        tolerations=tuple(_list_of_obj(spec, "tolerations")),
        affinity=_obj(spec, "affinity") or None,
        priority_class_name=spec.get("priorityClassName") or None,
        replicas=replicas,
        autoscaling=_parse_autoscaling(_obj(spec, "autoscaling")),
        service=_parse_service(_obj(spec, "service")),
        api_key_secret_ref=_parse_secret_ref(spec.get("apiKeySecretRef")),
        drain_timeout_seconds=_int(spec, "drainTimeoutSeconds", 30, minimum=0),
    )


def _parse_model(name: str, raw: dict[str, Any]) -> ModelSource:
    sources = [k for k in ("pvc", "hostPath", "image") if raw.get(k) is not None]
    if len(sources) != 1:
        raise ValueError(
            "spec.model needs exactly one of pvc, hostPath, image "
            f"(got {', '.join(sources) or 'none'})."
        )
    source = _obj(raw, sources[0], prefix="spec.model")
    served = _str(raw, "servedModelName", name, prefix="spec.model")
    if sources[0] == "pvc":
        return ModelSource(
            served_model_name=served,
            pvc_claim_name=_str(source, "claimName", None, prefix="spec.model.pvc"),
            path=_str(source, "path", "", prefix="spec.model.pvc"),
        )
    if sources[0] == "hostPath":
        return ModelSource(
            served_model_name=served,
            host_path=_str(source, "path", None, prefix="spec.model.hostPath"),
        )
    return ModelSource(
        served_model_name=served,
        image=_str(source, "image", None, prefix="spec.model.image"),
        path=_str(source, "path", None, prefix="spec.model.image"),
    )


def _parse_resources(raw: dict[str, Any]) -> Resources:
    def quantity(key: str) -> str | None:
        value = raw.get(key)
        return None if value is None else str(value)

    return Resources(
        gpus=_int(raw, "gpus", 1, minimum=0, prefix="spec.resources"),
        cpu=quantity("cpu"),
        memory=quantity("memory"),
    )


def _parse_autoscaling(raw: dict[str, Any]) -> Autoscaling:
    p = "spec.autoscaling"
    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"{p}.enabled must be true or false (got {enabled!r}).")
    scaling = Autoscaling(
        enabled=enabled,
        min_replicas=_int(raw, "minReplicas", 1, minimum=1, prefix=p),
        max_replicas=_int(raw, "maxReplicas", 4, minimum=1, prefix=p),
        target_kv_cache_usage=_num(raw, "targetKvCacheUsage", 0.8, p),
        target_queue_depth=_num(raw, "targetQueueDepth", 4.0, p),
        scale_up_stabilization_seconds=_num(raw, "scaleUpStabilizationSeconds", 0.0, p, zero=True),
        scale_down_stabilization_seconds=_num(raw, "scaleDownStabilizationSeconds", 300.0, p, zero=True),
        interval_seconds=_num(raw, "intervalSeconds", 15.0, p),
    )
    if scaling.min_replicas > scaling.max_replicas:
        raise ValueError(
            f"{p}.minReplicas ({scaling.min_replicas}) must not exceed "
            f"maxReplicas ({scaling.max_replicas})."
        )
    if scaling.target_kv_cache_usage > 1.0:
        raise ValueError(f"{p}.targetKvCacheUsage must be in (0, 1] (got {scaling.target_kv_cache_usage}).")
    return scaling


def _parse_service(raw: dict[str, Any]) -> ServiceSpec:
    svc_type = _str(raw, "type", "ClusterIP", prefix="spec.service")
    if svc_type not in SERVICE_TYPES:
        raise ValueError(f"spec.service.type must be one of {', '.join(SERVICE_TYPES)} (got {svc_type!r}).")
    port = _int(raw, "port", 8000, minimum=1, prefix="spec.service")
    if port > 65535:
        raise ValueError(f"spec.service.port must be <= 65535 (got {port}).")
    return ServiceSpec(type=svc_type, port=port)


def _parse_secret_ref(raw: Any) -> SecretRef | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("spec.apiKeySecretRef must be an object with name (and key).")
    p = "spec.apiKeySecretRef"
    return SecretRef(name=_str(raw, "name", None, prefix=p), key=_str(raw, "key", "api-key", prefix=p))


def _obj(raw: dict[str, Any], key: str, required: bool = False, prefix: str = "spec") -> dict[str, Any]:
    value = raw.get(key)
    if value is None:
        if required:
            raise ValueError(f"{prefix}.{key} is required.")
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{prefix}.{key} must be an object (got {type(value).__name__}).")
    return value


def _list_of_obj(raw: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = raw.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"spec.{key} must be a list of objects.")
    return value


def _str(raw: dict[str, Any], key: str, default: str | None, prefix: str = "spec") -> str:
    value = raw.get(key, default)
    if value is None:
        raise ValueError(f"{prefix}.{key} is required.")
    if not isinstance(value, str):
        raise ValueError(f"{prefix}.{key} must be a string (got {value!r}).")
    return value


def _int(raw: dict[str, Any], key: str, default: int, minimum: int, prefix: str = "spec") -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{prefix}.{key} must be an integer >= {minimum} (got {value!r}).")
    return value


def _num(raw: dict[str, Any], key: str, default: float, prefix: str, zero: bool = False) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ValueError(f"{prefix}.{key} must be a number {bound} (got {value!r}).")
    return float(value)
