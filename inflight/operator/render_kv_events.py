"""Pure builders for KV events between the runtime pods and the endpoint picker: the pods'
``--kv-events-config`` and the picker's precise-prefix scorer config (docs/kv-events.md).

With ``inferencePool.enabled`` every runtime pod publishes its prefix-cache events (vLLM's
format, :mod:`inflight.runtime.kv_events`) on a ZMQ PUB socket it binds on ``KV_EVENTS_PORT``,
under llm-d's topic ``kv@<pod-ip>:<port>@<model>`` (the pod's IP from the downward API, ``<port>``
the serving port: llm-d's scorer keys a pod by ``address:port``). An llm-d inference scheduler
picker (``ghcr.io/llm-d/llm-d-inference-scheduler``, whose ``precise-prefix-cache-scorer`` reads
those events; the Gateway API Inference Extension's own picker has no such plugin) gets an
``EndpointPickerConfig`` through ``--config-text`` that dials each pod on that port. Nothing is
rendered when the spec turns prefix caching off or sets ``--kv-events-config`` in extraArgs.
Knows nothing about I/O.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from inflight.operator.spec import InferenceSpec
from inflight.runtime.config import EngineConfig

KV_EVENTS_PORT = 5557  # llm-d's podDiscoveryConfig.socketPort default
PRECISE_PICKER_IMAGE = "llm-d-inference-scheduler"  # the picker images that carry the precise scorer
POD_IP_ENV = "POD_IP"
FLAG = "--kv-events-config"


def publishes(spec: InferenceSpec) -> bool:
    """Whether the pods publish KV events the operator configured."""
    caching = spec.engine.get("enable_prefix_caching", EngineConfig().enable_prefix_caching)
    user_set = any(a == FLAG or a.startswith(FLAG + "=") for a in spec.extra_args)
    return spec.inference_pool.enabled and caching and not user_set


def topic(spec: InferenceSpec, container_port: int) -> str:
    return f"kv@$({POD_IP_ENV}):{container_port}@{spec.model.served_model_name}"


def runtime_args(spec: InferenceSpec, container_port: int) -> list[str]:
    """``--kv-events-config`` for the runtime container (``$(POD_IP)`` is expanded by the kubelet)."""
    if not publishes(spec):
        return []
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
              "topic": topic(spec, container_port)}
    return [FLAG, json.dumps(config, separators=(",", ":"))]


def runtime_env(spec: InferenceSpec) -> list[dict[str, Any]]:
    """``POD_IP`` from the downward API, unless the spec's env sets it already."""
    if not publishes(spec) or any(e.get("name") == POD_IP_ENV for e in spec.pod.env):
        return []
    return [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]


def runtime_ports(spec: InferenceSpec) -> list[dict[str, Any]]:
    if not publishes(spec):
        return []
    return [{"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"}]


def precise_picker(spec: InferenceSpec) -> bool:
    """Whether the rendered picker runs the precise-prefix scorer (an llm-d scheduler image)."""
    image = spec.inference_pool.picker_image.rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]
    return spec.inference_pool.create_picker and publishes(spec) and image == PRECISE_PICKER_IMAGE


def picker_config(spec: InferenceSpec) -> dict[str, Any]:
    """The picker's EndpointPickerConfig: the precise-prefix scorer first, then KV usage and queue
    depth. Prompts are tokenized by llm-d's ``token-producer`` against the runtime Service."""
    block_size = spec.engine.get("block_size", EngineConfig().block_size)
    runtime_url = f"http://{spec.name}.{spec.namespace}.svc:{spec.service.port}"
    weights = {"precise-prefix-cache-scorer": 2.0, "kv-cache-utilization-scorer": 1.0, "queue-scorer": 1.0}
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "token-producer",
             "parameters": {"modelName": spec.model.served_model_name, "vllm": {"http": runtime_url}}},
            {"type": "single-profile-handler"},
            {"type": "precise-prefix-cache-scorer", "parameters": {
                "tokenProcessorConfig": {"blockSize": block_size},
                "kvEventsConfig": {"topicFilter": "kv@", "concurrency": 4, "discoverPods": True,
                                   "podDiscoveryConfig": {"socketPort": KV_EVENTS_PORT}},
            }},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [
            *({"pluginRef": name, "weight": weight} for name, weight in weights.items()),
            {"pluginRef": "max-score-picker"},
        ]}],
    }


def picker_args(spec: InferenceSpec) -> list[str]:
    """``--config-text`` with :func:`picker_config` for an llm-d scheduler picker, else nothing."""
    if not precise_picker(spec):
        return []
    return ["--config-text", yaml.safe_dump(picker_config(spec), sort_keys=False)]
