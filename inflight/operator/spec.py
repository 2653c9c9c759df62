"""Typed InferenceDeployment spec: frozen dataclasses parsed and validated from the CR dict.

Owns: the shape of ``spec`` as Python values (model sources in ``model_source``, pod passthrough and rollout in
``pod_settings``), ``resources.gpus`` -> tensor-parallel size, the operator-side defaults that are not engine knobs
(engine defaults live in EngineConfig only), and the validation a CR must pass before anything is rendered
(``parse_spec`` raises ``ValueError`` naming the field; a host KV tier's fit in memory: ``host_memory``). Each
default is written once, on its dataclass field: the parsers and the CRD builder (:mod:`.crd`) read it from there.
Knows nothing about Kubernetes I/O or manifests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from inflight import env_vars
from inflight.operator import engine_args, fields, multi_node, partners
from inflight.operator.adapter_source import Adapter, check_adapter_mounts, parse_adapters, with_lora
from inflight.operator.host_memory import check_host_memory
from inflight.operator.model_source import ModelSource, parse_model
from inflight.operator.pod_runtime import KERNEL_CACHE_ENV, PodRuntime, parse_pod_runtime
from inflight.operator.pod_settings import (
    DisruptionBudget,
    PodSettings,
    Rollout,
    parse_disruption_budget,
    parse_pod_settings,
    parse_rollout,
)
from inflight.operator.pool_spec import EPP_IMAGE, InferencePoolSpec, parse_inference_pool
from inflight.runtime.config import DRAIN_TIMEOUT_S

RUNTIME_IMAGE = "ghcr.io/inflight-dev/inflight-runtime:0.1.0"
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
METRICS_KEY_ENV = "INFLIGHT_METRICS_API_KEY"  # the runtime reads it (inflight.runtime.cli.command)


@dataclass(frozen=True, slots=True)
class SpecDefaults:
    """The defaults the operator's installation chooses for what a spec leaves out: the chart's
    ``runtimeImage`` and ``pickerImage`` values reach the operator as env vars, so the CRD
    carries no image default of its own (it would fill in the built-in one first)."""

    runtime_image: str = RUNTIME_IMAGE
    picker_image: str = EPP_IMAGE
    picker_cluster_role: str = ""  # the chart's ClusterRole for pickers ("": no picker RBAC rendered)
    picker_metrics_auth: bool = True  # the picker's /metrics behind TokenReview + SubjectAccessReview

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SpecDefaults:
        """From ``INFLIGHT_OPERATOR_RUNTIME_IMAGE`` / ``_PICKER_IMAGE`` / ``_PICKER_CLUSTER_ROLE``; an
        empty or spaced value is refused (``ValueError``) rather than rendered into every pod."""
        values: dict[str, str] = {}
        for name, var in (("runtime_image", "INFLIGHT_OPERATOR_RUNTIME_IMAGE"),
                          ("picker_image", "INFLIGHT_OPERATOR_PICKER_IMAGE"),
                          ("picker_cluster_role", "INFLIGHT_OPERATOR_PICKER_CLUSTER_ROLE")):
            raw = env_vars.read_str(var, env)
            if raw is None:
                continue
            if not raw or any(c.isspace() for c in raw):
                raise ValueError(f"{var} must be an image reference like repo/name:tag (got {raw!r}).")
            values[name] = raw
        auth = (env_vars.read_str("INFLIGHT_OPERATOR_PICKER_METRICS_AUTH", env) or "").lower()
        if auth not in ("true", "false"):
            raise ValueError(f"INFLIGHT_OPERATOR_PICKER_METRICS_AUTH must be true or false (got {auth!r}).")
        return cls(**values, picker_metrics_auth=auth == "true")


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
    target_ttft_seconds: float | None = None  # seconds of TTFT backlog per pod; None: signal off
    scale_up_stabilization_seconds: float = 0.0
    scale_down_stabilization_seconds: float = 300.0
    interval_seconds: float = 15.0
    partner: partners.Partner | None = None  # an HPA or KEDA writes the replicas (``partners``)


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    type: str = "ClusterIP"
    port: int = 8000
    annotations: dict[str, str] = field(default_factory=dict)  # e.g. an internal load balancer


@dataclass(frozen=True, slots=True)
class SecretRef:
    name: str
    key: str = "api-key"


@dataclass(frozen=True, slots=True)
class MetricsKeyRef:
    """The Secret entry whose value the pods' ``GET /metrics`` requires (env
    ``INFLIGHT_METRICS_API_KEY``): a scraper's token that many deployments can share without
    giving the scraper their inference key."""

    name: str
    key: str = "token"  # the chart's serviceMonitor.authorization.key default


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
    metrics_api_key_secret_ref: MetricsKeyRef | None = None
    drain_timeout_seconds: int = DRAIN_TIMEOUT_S  # the server's --drain-timeout default
    pod: PodSettings = PodSettings()
    runtime: PodRuntime = PodRuntime()
    rollout: Rollout = Rollout()
    inference_pool: InferencePoolSpec = InferencePoolSpec()
    disruption_budget: DisruptionBudget = DisruptionBudget()
    adapters: tuple[Adapter, ...] = ()  # LoRA adapters, loaded into the pods live (``adapters``)
    nodes: int = 1  # pods one copy of the model spans (> 1: a LeaderWorkerSet, ``multi_node``)


_Ref = TypeVar("_Ref", SecretRef, MetricsKeyRef)


def parse_spec(name: str, namespace: str, spec: dict[str, Any], defaults: SpecDefaults | None = None
               ) -> InferenceSpec:
    """Validate a CR ``spec`` dict into an InferenceSpec; raise ``ValueError`` naming the field.
    ``defaults``: the installation's images (``None``: read from the operator's env vars)."""
    if not isinstance(spec, dict):
        raise ValueError("spec must be an object.")
    defaults = SpecDefaults.from_env() if defaults is None else defaults
    engine_raw = dict(_obj(spec, "engine"))
    extra_args = engine_raw.pop("extraArgs", None) or []
    if not isinstance(extra_args, list) or not all(isinstance(a, str) for a in extra_args):
        raise ValueError("spec.engine.extraArgs must be a list of strings.")
    replicas = _int(spec, "replicas", fields.default(InferenceSpec, "replicas"), minimum=0)
    nodes = multi_node.parse_nodes(spec)
    resources_raw = _obj(spec, "resources")
    resources = _parse_resources(resources_raw)
    pod = parse_pod_settings(spec, resources_raw)
    runtime = parse_pod_runtime(spec, resources_raw)
    if runtime.kernel_cache_claim is not None and (taken := sorted(
            {e.get("name") for e in pod.env} & set(KERNEL_CACHE_ENV))):
        raise ValueError(f"spec.env sets {', '.join(taken)}, which spec.kernelCache points at its volume; "
                         "drop one of them.")
    model = parse_model(name, _obj(spec, "model", required=True))
    adapters = parse_adapters(spec.get("adapters"), model.served_model_name)
    parsed = InferenceSpec(
        name=name,
        namespace=namespace,
        model=model,
        engine=with_lora(multi_node.with_pipeline_parallel(
            _with_tensor_parallel(engine_args.parse_engine(engine_raw), resources.gpus), nodes), adapters),
        extra_args=tuple(extra_args),
        image=_str(spec, "image", defaults.runtime_image),
        resources=resources,
        node_selector={str(k): str(v) for k, v in _obj(spec, "nodeSelector").items()},
        tolerations=tuple(_list_of_obj(spec, "tolerations")),
        affinity=_obj(spec, "affinity") or None,
        priority_class_name=spec.get("priorityClassName") or None,
        replicas=replicas,
        autoscaling=_parse_autoscaling(_obj(spec, "autoscaling")),
        service=_parse_service(_obj(spec, "service")),
        api_key_secret_ref=_parse_secret_ref(spec, "apiKeySecretRef", SecretRef),
        metrics_api_key_secret_ref=_parse_secret_ref(spec, "metricsApiKeySecretRef", MetricsKeyRef),
        drain_timeout_seconds=_int(spec, "drainTimeoutSeconds", fields.default(InferenceSpec, "drain_timeout_seconds"),
                                   minimum=0),
        pod=pod,
        runtime=runtime,
        rollout=parse_rollout(_obj(spec, "rollout")),
        inference_pool=parse_inference_pool(_obj(spec, "inferencePool"), defaults.picker_image,
                                            defaults.picker_cluster_role, defaults.picker_metrics_auth),
        disruption_budget=parse_disruption_budget(_obj(spec, "disruptionBudget")),
        adapters=adapters,
        nodes=nodes,
    )
    _check_metrics_key(parsed)
    _check_cache_sharing(parsed)
    _check_multi_node(parsed)
    check_host_memory(parsed.engine, parsed.extra_args, parsed.resources.memory)
    if lora_enabled(parsed):
        check_adapter_mounts(parsed.pod.volumes, parsed.pod.volume_mounts)
    return parsed


def max_replicas(spec: InferenceSpec) -> int:
    """The most pods the spec may run at once in steady state (autoscaling's max when on)."""
    return spec.autoscaling.max_replicas if spec.autoscaling.enabled else spec.replicas


def _check_cache_sharing(spec: InferenceSpec) -> None:
    """A cache PVC the operator creates ReadWriteOnce (the default without a class) attaches to
    one node, ReadWriteOncePod to one pod: a second replica elsewhere would hang in
    ContainerCreating on a Multi-Attach error. Refused rather than pinned to one node, which
    would quietly make every replica share one failure domain and one node's GPUs."""
    cache = spec.model.cache
    if cache is None or cache.size is None or cache.access_mode == "ReadWriteMany" or max_replicas(spec) <= 1:
        return
    many = (f"spec.autoscaling.maxReplicas is {spec.autoscaling.max_replicas}" if spec.autoscaling.enabled
            else f"spec.replicas is {spec.replicas}")
    raise ValueError(
        f"spec.model.cache.accessMode is {cache.access_mode} but {many}: the cache PVC attaches to one "
        f"{'pod' if cache.access_mode == 'ReadWriteOncePod' else 'node'}, so the other replicas would hang in "
        "ContainerCreating (Multi-Attach). Set cache.storageClassName to a class that offers ReadWriteMany "
        "(accessMode ReadWriteMany), use an existing shared claim (cache.claimName), drop the cache "
        "(each pod downloads into its own volume), or run one replica."
    )


def _check_multi_node(spec: InferenceSpec) -> None:
    cache = spec.model.cache
    multi_node.check(spec.nodes, min_replicas=spec.autoscaling.min_replicas if spec.autoscaling.enabled else None,
                     pool=spec.inference_pool.enabled, lora=lora_enabled(spec),
                     cache_access_mode=None if cache is None or cache.size is None else cache.access_mode)


def _with_tensor_parallel(engine: dict[str, Any], gpus: int) -> dict[str, Any]:
    """``tensor_parallel_size`` defaults to the pod's GPUs; an explicit value must equal them.

    With ``gpus: 0`` (CPU pods) an explicit value is kept (CPU ranks over gloo). Whether the
    model's attention heads divide by it is checked by the runtime at start (the operator
    never sees the model's config).
    """
    tp = engine.get("tensor_parallel_size")
    if tp is None:
        if gpus <= 1:
            return engine
        filled = {**engine, "tensor_parallel_size": gpus}
        try:  # validated again as the pod will run it: some engine options refuse TP > 1
            engine_args.validate_engine(filled)
        except ValueError as exc:
            raise ValueError(f"{exc} (spec.resources.gpus: {gpus} runs tensorParallelSize {gpus}; use "
                             "gpus: 1 or drop the option)") from exc
        return filled
    if gpus > 0 and tp != gpus:
        raise ValueError(
            f"spec.engine.tensorParallelSize ({tp}) must equal spec.resources.gpus ({gpus}): each rank "
            "drives one GPU of the pod. Leave tensorParallelSize unset to follow gpus."
        )
    return engine


def lora_enabled(spec: InferenceSpec) -> bool:
    """Whether the pods run with ``--enable-lora`` (adapters listed, or ``engine.enableLora``)."""
    return bool(spec.engine.get("enable_lora"))


def _parse_resources(raw: dict[str, Any]) -> Resources:
    def quantity(key: str) -> str | None:
        value = raw.get(key)
        return None if value is None else str(value)

    return Resources(
        gpus=_int(raw, "gpus", Resources().gpus, minimum=0, prefix="spec.resources"),
        cpu=quantity("cpu"),
        memory=quantity("memory"),
    )


def _parse_autoscaling(raw: dict[str, Any]) -> Autoscaling:
    p, d = "spec.autoscaling", Autoscaling()
    enabled = raw.get("enabled", d.enabled)
    if not isinstance(enabled, bool):
        raise ValueError(f"{p}.enabled must be true or false (got {enabled!r}).")
    scaling = Autoscaling(
        enabled=enabled,
        min_replicas=_int(raw, "minReplicas", d.min_replicas, minimum=0, prefix=p),  # 0: scale_to_zero
        max_replicas=_int(raw, "maxReplicas", d.max_replicas, minimum=1, prefix=p),
        target_kv_cache_usage=_num(raw, "targetKvCacheUsage", d.target_kv_cache_usage, p),
        target_queue_depth=_num(raw, "targetQueueDepth", d.target_queue_depth, p),
        target_ttft_seconds=fields.optional_number(raw, "targetTtftSeconds", p),
        scale_up_stabilization_seconds=_num(raw, "scaleUpStabilizationSeconds", d.scale_up_stabilization_seconds,
                                            p, zero=True),
        scale_down_stabilization_seconds=_num(raw, "scaleDownStabilizationSeconds",
                                              d.scale_down_stabilization_seconds, p, zero=True),
        interval_seconds=_num(raw, "intervalSeconds", d.interval_seconds, p),
        partner=partners.parse(raw.get("partner"), _int(raw, "minReplicas", d.min_replicas, minimum=0, prefix=p)))
    if scaling.min_replicas > scaling.max_replicas:
        raise ValueError(f"{p}.minReplicas ({scaling.min_replicas}) must not exceed maxReplicas ({scaling.max_replicas}).")
    if scaling.target_kv_cache_usage > 1.0:
        raise ValueError(f"{p}.targetKvCacheUsage must be in (0, 1] (got {scaling.target_kv_cache_usage}).")
    return scaling


def _parse_service(raw: dict[str, Any]) -> ServiceSpec:
    d = ServiceSpec()
    svc_type = _str(raw, "type", d.type, prefix="spec.service")
    if svc_type not in SERVICE_TYPES:
        raise ValueError(f"spec.service.type must be one of {', '.join(SERVICE_TYPES)} (got {svc_type!r}).")
    port = _int(raw, "port", d.port, minimum=1, prefix="spec.service")
    if port > 65535:
        raise ValueError(f"spec.service.port must be <= 65535 (got {port}).")
    return ServiceSpec(type=svc_type, port=port, annotations=fields.string_map(raw, "annotations", "spec.service"))


def _parse_secret_ref(spec: dict[str, Any], field_name: str, cls: type[_Ref]) -> _Ref | None:
    raw = spec.get(field_name)
    if raw is None:
        return None
    p = f"spec.{field_name}"
    if not isinstance(raw, dict):
        raise ValueError(f"{p} must be an object with name (and key).")
    name = fields.matching(_str(raw, "name", None, prefix=p), fields.DNS_SUBDOMAIN, f"{p}.name", "my-secret")
    key = fields.matching(_str(raw, "key", fields.default(cls, "key"), prefix=p), fields.SECRET_KEY, f"{p}.key",
                          fields.default(cls, "key"))
    return cls(name=name, key=key)


def passes_metrics_key(spec: InferenceSpec) -> bool:
    """Whether ``extraArgs`` (``--metrics-api-key``) or ``spec.env`` (its env var) give the pods a
    metrics key of their own making."""
    return any(a.startswith("--metrics-api-key") for a in spec.extra_args) or any(
        e.get("name") == METRICS_KEY_ENV for e in spec.pod.env)


def _check_metrics_key(spec: InferenceSpec) -> None:
    """What the runtime would refuse at start, or what would blind the endpoint picker, as a
    spec error: the metrics key is the inference key, set twice, or closes /metrics to a picker."""
    ref, p = spec.metrics_api_key_secret_ref, "spec.metricsApiKeySecretRef"
    if ref is None:
        return
    api = spec.api_key_secret_ref
    if api is not None and (api.name, api.key) == (ref.name, ref.key):
        raise ValueError(f"{p} names the same Secret entry as spec.apiKeySecretRef; the metrics key must differ "
                         "from the inference key (the runtime refuses them equal).")
    if passes_metrics_key(spec):
        raise ValueError(f"{p} and a --metrics-api-key in spec.engine.extraArgs or {METRICS_KEY_ENV} in spec.env "
                         "both set the metrics key; keep one.")
    if spec.inference_pool.enabled:
        raise ValueError(f"{p} would close /metrics to the InferencePool's endpoint picker, which sends no key "
                         "(behind a pool the pods serve /metrics to anyone, Prometheus included); drop it.")


def _obj(raw: dict[str, Any], key: str, required: bool = False, prefix: str = "spec") -> dict[str, Any]:
    return fields.obj(raw, key, prefix, required)


def _list_of_obj(raw: dict[str, Any], key: str) -> list[dict[str, Any]]:
    return fields.list_of_obj(raw, key, "spec")


def _str(raw: dict[str, Any], key: str, default: str | None, prefix: str = "spec") -> str:
    return fields.string(raw, key, default, prefix)


def _int(raw: dict[str, Any], key: str, default: int, minimum: int, prefix: str = "spec") -> int:
    return fields.integer(raw, key, default, minimum, prefix)


def _num(raw: dict[str, Any], key: str, default: float, prefix: str, zero: bool = False) -> float:
    return fields.number(raw, key, default, prefix, zero)
