"""Pure builders for the Gateway API Inference Extension wiring: an InferencePool over the
runtime pods and the endpoint picker (EPP) it names.

Owns the shapes of ``InferencePool`` (``inference.networking.k8s.io/v1``: ``selector.matchLabels``,
``targetPorts``, ``endpointPickerRef``) and of the picker's Deployment, Service and, when the
installation names the picker's ClusterRole, its ServiceAccount and RoleBinding (``<name>-epp``),
including how the picker is told our metric names. Two dialects: llm-d's router picker (the
default image, ``pool_spec.EPP_IMAGE``) refuses the old metric flags and reads them from its
``EndpointPickerConfig`` (``--config-text``: the core metrics extractor's ``engineConfigs`` with
an ``inflight`` engine made the default, so the pods need no engine label); GIE's ``epp`` and
llm-d's older scheduler image take ``--total-queued-requests-metric``,
``--total-running-requests-metric``, ``--kv-cache-usage-percentage-metric`` and
``--lora-info-metric`` (``--cache-info-metric`` empty: the runtime publishes no cache-config info
metric). ``replicas`` > 1 runs the picker's leader election (``--ha-enable-leader-election``):
only the leader is Ready, so the probes ask the ``liveness``/``readiness`` health services,
the rollout replaces one pod at a time without waiting for a standby to turn Ready, and a
preferred pod anti-affinity on the node (``kubernetes.io/hostname``) spreads the replicas.
The picker's ``/metrics`` (port ``metrics`` on its Service too) asks for a token by default
(``--metrics-endpoint-auth``, true in GIE's epp and llm-d's router: a TokenReview and a
SubjectAccessReview for ``get`` on the non-resource URL ``/metrics``); the installation can turn
that off (``--metrics-endpoint-auth=false``). Knows nothing about I/O.
"""

from __future__ import annotations

from typing import Any

import yaml

from inflight.operator import render_kv_events
from inflight.operator.spec import InferenceSpec, lora_enabled

POOL_API_VERSION = "inference.networking.k8s.io/v1"
EPP_GRPC_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
QUEUE_METRIC = "inflight:num_requests_waiting"
RUNNING_METRIC = "inflight:num_requests_running"
KV_METRIC = "inflight:kv_cache_usage_perc"
LORA_METRIC = "vllm:lora_requests_info"  # running/waiting adapters: the picker's adapter affinity
ROUTER_IMAGE_NAME = "llm-d-router-endpoint-picker"  # llm-d's router picker: metrics from its config only
ENGINE = "inflight"  # the core metrics extractor's engine name for our pods
RBAC_API = "rbac.authorization.k8s.io"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


def picker_name(name: str) -> str:
    return f"{name}-epp"


def picker_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "inflight-epp", "app.kubernetes.io/instance": name}


def render_inference_pool(spec: InferenceSpec, metadata: dict[str, Any], selector: dict[str, str],
                          target_port: int) -> dict[str, Any]:
    pool = spec.inference_pool
    service = pool.picker_service or picker_name(spec.name)
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": metadata,
        "spec": {
            "selector": {"matchLabels": dict(selector)},
            "targetPorts": [{"number": target_port}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": service,
                "port": {"number": pool.picker_port},
                "failureMode": pool.failure_mode,
            },
        },
    }


def router_picker(spec: InferenceSpec) -> bool:
    """Whether the picker image is llm-d's router picker (metric names in its config, not flags)."""
    image = spec.inference_pool.picker_image.rsplit("/", 1)[-1].split("@", 1)[0].split(":", 1)[0]
    return image == ROUTER_IMAGE_NAME


def router_config(spec: InferenceSpec) -> dict[str, Any]:
    """llm-d router's EndpointPickerConfig: its default scorers (queue 2, KV usage 2, prefix 3) over
    metrics read with our names (an ``inflight`` engine, made the default)."""
    engine = {"name": ENGINE, "queuedRequestsSpec": QUEUE_METRIC, "runningRequestsSpec": RUNNING_METRIC,
              "kvUsageSpec": KV_METRIC, "loraSpec": LORA_METRIC if lora_enabled(spec) else "", "cacheInfoSpec": ""}
    weights = {"queue-scorer": 2.0, "kv-cache-utilization-scorer": 2.0, "prefix-cache-scorer": 3.0}
    return {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            *({"type": name} for name in weights),
            {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
            {"type": "core-metrics-extractor", "parameters": {"defaultEngine": ENGINE, "engineConfigs": [engine]}},
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [
            {"pluginRef": name, "weight": weight} for name, weight in weights.items()]}],
        "dataLayer": {"sources": [{"pluginRef": "metrics-data-source",
                                   "extractors": [{"pluginRef": "core-metrics-extractor"}]}]},
    }


def picker_args(spec: InferenceSpec) -> list[str]:
    pool = spec.inference_pool
    args = [
        "--pool-name", spec.name,
        "--pool-namespace", spec.namespace,
        "--pool-group", POOL_API_VERSION.split("/")[0],
        "--grpc-port", str(pool.picker_port),
        "--grpc-health-port", str(EPP_GRPC_HEALTH_PORT),
        "--metrics-port", str(EPP_METRICS_PORT),
    ]
    if router_picker(spec):
        args += ["--config-text", yaml.safe_dump(router_config(spec), sort_keys=False)]
    else:
        args += [
            "--total-queued-requests-metric", QUEUE_METRIC,
            "--total-running-requests-metric", RUNNING_METRIC,
            "--kv-cache-usage-percentage-metric", KV_METRIC,
            "--lora-info-metric", LORA_METRIC if lora_enabled(spec) else "",
            "--cache-info-metric", "",
        ]
    args += ["--zap-encoder", "json"]
    if not pool.picker_metrics_auth:  # on by default in every picker image: only the opt-out is passed
        args.append("--metrics-endpoint-auth=false")
    if pool.picker_replicas > 1:
        args.append("--ha-enable-leader-election")
    if not router_picker(spec):
        args += render_kv_events.picker_args(spec)  # the precise-prefix scorer, on an llm-d scheduler image
    return args


def picker_service_account(spec: InferenceSpec) -> str | None:
    """The picker pods' ServiceAccount: the spec's, else the one rendered with the RBAC (``<name>-epp``)."""
    pool = spec.inference_pool
    if pool.picker_service_account:
        return pool.picker_service_account
    return picker_name(spec.name) if pool.picker_cluster_role else None


def render_picker_rbac(spec: InferenceSpec, metadata: dict[str, Any]) -> list[dict[str, Any]]:
    """The picker's ServiceAccount and a RoleBinding in the model's namespace to the ClusterRole the
    chart ships with the picker's rights (pods, InferencePools, InferenceObjectives, Leases for its
    leader election, Events); none when the installation names no such ClusterRole or the spec
    names a ServiceAccount of its own."""
    pool = spec.inference_pool
    if not pool.picker_cluster_role or pool.picker_service_account:
        return []
    name = picker_name(spec.name)
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {**metadata, "name": name}}
    binding = {
        "apiVersion": f"{RBAC_API}/v1", "kind": "RoleBinding", "metadata": {**metadata, "name": name},
        "roleRef": {"apiGroup": RBAC_API, "kind": "ClusterRole", "name": pool.picker_cluster_role},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": spec.namespace}],
    }
    return [account, binding]


def render_picker_deployment(spec: InferenceSpec, metadata: dict[str, Any]) -> dict[str, Any]:
    pool = spec.inference_pool
    ha = pool.picker_replicas > 1  # only the leader is Ready: liveness and readiness are separate services

    def probe(service: str) -> dict[str, Any]:
        return {"grpc": {"port": EPP_GRPC_HEALTH_PORT, "service": service if ha else "inference-extension"},
                "periodSeconds": 10}

    pod_spec: dict[str, Any] = {
        "containers": [{
            "name": "epp",
            "image": pool.picker_image,
            "args": picker_args(spec),
            "ports": [
                {"name": "grpc", "containerPort": pool.picker_port},
                {"name": "grpc-health", "containerPort": EPP_GRPC_HEALTH_PORT},
                {"name": "metrics", "containerPort": EPP_METRICS_PORT},
            ],
            "livenessProbe": {**probe("liveness"), "initialDelaySeconds": 5},
            "readinessProbe": probe("readiness"),
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                "runAsNonRoot": True},
        }],
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if (account := picker_service_account(spec)) is not None:
        pod_spec["serviceAccountName"] = account
    if spec.pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.pod.image_pull_secrets]
    labels = picker_labels(spec.name)
    if ha:  # a standby on another node: one node's loss does not take the leader and its standbys
        pod_spec["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {"labelSelector": {"matchLabels": dict(labels)}, "topologyKey": HOSTNAME_TOPOLOGY},
        }]}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": pool.picker_replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            # A new pod only turns Ready once it leads: with standbys, replace one at a time without surging.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": (
                {"maxUnavailable": 1, "maxSurge": 0} if ha else {"maxUnavailable": 0, "maxSurge": 1})},
        },
    }


def render_picker_service(spec: InferenceSpec, metadata: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": "ClusterIP",
            "selector": picker_labels(spec.name),
            "ports": [{"name": "grpc-ext-proc", "port": spec.inference_pool.picker_port,
                       "targetPort": "grpc", "protocol": "TCP", "appProtocol": "http2"},
                      # The picker's own metrics, for the chart's ServiceMonitor (serviceMonitor.pickers).
                      {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }
