"""Pure builders for the Gateway API Inference Extension wiring: an InferencePool over the
runtime pods and the endpoint picker (EPP) it names.

Owns the shapes of ``InferencePool`` (``inference.networking.k8s.io/v1``: ``selector.matchLabels``,
``targetPorts``, ``endpointPickerRef``) and of the picker's Deployment and Service
(``<name>-epp``), including how the picker is told our metric names: the EPP's
``--total-queued-requests-metric``, ``--total-running-requests-metric`` and
``--kv-cache-usage-percentage-metric`` flags name the runtime's gauges (docs/metrics.md);
``--lora-info-metric`` and ``--cache-info-metric`` are set empty because the runtime serves no
LoRA adapters and publishes no cache-config info metric. Knows nothing about I/O.
"""

from __future__ import annotations

from typing import Any

from inflight.operator import render_kv_events
from inflight.operator.spec import InferenceSpec, lora_enabled

POOL_API_VERSION = "inference.networking.k8s.io/v1"
EPP_GRPC_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
QUEUE_METRIC = "inflight:num_requests_waiting"
RUNNING_METRIC = "inflight:num_requests_running"
KV_METRIC = "inflight:kv_cache_usage_perc"
LORA_METRIC = "vllm:lora_requests_info"  # running/waiting adapters: the picker's adapter affinity


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


def picker_args(spec: InferenceSpec) -> list[str]:
    return [
        "--pool-name", spec.name,
        "--pool-namespace", spec.namespace,
        "--pool-group", POOL_API_VERSION.split("/")[0],
        "--grpc-port", str(spec.inference_pool.picker_port),
        "--grpc-health-port", str(EPP_GRPC_HEALTH_PORT),
        "--metrics-port", str(EPP_METRICS_PORT),
        "--total-queued-requests-metric", QUEUE_METRIC,
        "--total-running-requests-metric", RUNNING_METRIC,
        "--kv-cache-usage-percentage-metric", KV_METRIC,
        "--lora-info-metric", LORA_METRIC if lora_enabled(spec) else "",
        "--cache-info-metric", "",
        "--zap-encoder", "json",
        *render_kv_events.picker_args(spec),  # the precise-prefix scorer, on an llm-d scheduler image
    ]


def render_picker_deployment(spec: InferenceSpec, metadata: dict[str, Any]) -> dict[str, Any]:
    pool = spec.inference_pool
    probe = {"grpc": {"port": EPP_GRPC_HEALTH_PORT, "service": "inference-extension"}, "periodSeconds": 10}
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
            "livenessProbe": {**probe, "initialDelaySeconds": 5},
            "readinessProbe": probe,
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                                "runAsNonRoot": True},
        }],
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if pool.picker_service_account:
        pod_spec["serviceAccountName"] = pool.picker_service_account
    if spec.pod.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.pod.image_pull_secrets]
    labels = picker_labels(spec.name)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
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
                       "targetPort": "grpc", "protocol": "TCP", "appProtocol": "http2"}],
        },
    }
