"""Builds the InferenceDeployment CRD (apiextensions.k8s.io/v1) from Python values.

Owns the CRD's schema: the engine properties are generated from EngineConfig (types, help
texts, choices: ``crd_engine``), so the CRD can never drift from the runtime's knobs, and the other fields'
defaults are read from the operator's spec dataclasses (:mod:`.spec`), which the parsers read
too (``tests/operator/test_crd_defaults.py`` checks they agree). ``crds/`` holds the
rendered YAML (the single source the chart copies); a test fails when the file and
``build_crd()`` differ. Regenerate with ``python -m inflight.operator.crd > crds/...yaml``.
Knows nothing about Kubernetes I/O.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from inflight.operator import crd_engine, crd_parts, fields, multi_node
from inflight.operator.render import API_GROUP, API_VERSION, KIND
from inflight.operator.spec import (
    RUNTIME_IMAGE,
    SERVICE_TYPES,
    Autoscaling,
    InferenceSpec,
    MetricsKeyRef,
    Resources,
    SecretRef,
    ServiceSpec,
)

PLURAL = "inferencedeployments"
CRD_FILE = f"crds/{API_GROUP}_{PLURAL}.yaml"
def _str(desc: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": desc, **extra}


def _int(desc: str, minimum: int, default: int | None = None, **extra: Any) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": "integer", "minimum": minimum, "description": desc, **extra}
    if default is not None:
        prop["default"] = default
    return prop


def _model_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "Where the weights are: exactly one of pvc, hostPath, image, hf.",
        "properties": {
            "servedModelName": _str("Model name clients send in requests (default: the resource name)."),
            "pvc": {
                "type": "object",
                "required": ["claimName"],
                "properties": {
                    "claimName": _str("PersistentVolumeClaim holding the weights (mounted read-only)."),
                    "path": _str("Directory of the model inside the volume.", default=""),
                },
            },
            "hostPath": {
                "type": "object",
                "required": ["path"],
                "properties": {"path": _str("Directory of the model on the node.")},
            },
            "image": {
                "type": "object",
                "required": ["image", "path"],
                "properties": {
                    "image": _str("Image that contains the weights (copied by an init container)."),
                    "path": _str("Directory of the model inside that image."),
                },
            },
            "hf": crd_parts.hf_schema(),
            "cache": crd_parts.cache_schema(),
        },
        "x-kubernetes-validations": [
            {
                "rule": "[has(self.pvc), has(self.hostPath), has(self.image), has(self.hf)]"
                        ".filter(x, x).size() == 1",
                "message": "set exactly one of pvc, hostPath, image, hf",
            },
            {"rule": "!has(self.cache) || has(self.hf)", "message": "cache is only used with hf"},
        ],
    }


def _autoscaling_schema() -> dict[str, Any]:
    def num(desc: str, default: float, minimum: float, exclusive: bool) -> dict[str, Any]:
        prop: dict[str, Any] = {"type": "number", "default": default, "minimum": minimum, "description": desc}
        if exclusive:
            prop["exclusiveMinimum"] = True
        return prop

    d = Autoscaling()
    kv = num("Target KV-cache usage per pod, a fraction in (0, 1].", d.target_kv_cache_usage, 0, True)
    kv["maximum"] = 1
    kv["x-kubernetes-validations"] = [crd_engine.FRACTION_RULE]
    return {
        "type": "object",
        "description": "Replicas from KV-cache usage, queue depth and (with targetTtftSeconds) the TTFT "
                       "backlog (the operator owns replicas when enabled).",
        "properties": {
            "enabled": {"type": "boolean", "default": d.enabled, "description": "Turn autoscaling on."},
            "minReplicas": _int("Fewest replicas; 0 scales to zero behind the chart's activator "
                                 "(docs/operator-scale-to-zero.md).", 0, d.min_replicas),
            "maxReplicas": _int("Most replicas.", 1, d.max_replicas),
            "targetKvCacheUsage": kv,
            "targetQueueDepth": num("Target waiting requests per ready pod.", d.target_queue_depth, 0, True),
            "targetTtftSeconds": {
                "type": "number", "minimum": 0, "exclusiveMinimum": True,
                "description": "Target seconds of TTFT backlog per ready pod: its queued prompt tokens over its "
                               "measured prefill rate (docs/autoscaling.md). Unset: this signal is off.",
            },
            "scaleUpStabilizationSeconds": num("Scale up to the lowest recommendation of this window.",
                                               d.scale_up_stabilization_seconds, 0, False),
            "scaleDownStabilizationSeconds": num("Scale down to the highest recommendation of this window.",
                                                 d.scale_down_stabilization_seconds, 0, False),
            "intervalSeconds": num("Seconds between metric scrapes and decisions.", d.interval_seconds, 0, True),
            "partner": crd_parts.partner_schema()},
        "x-kubernetes-validations": [
            {"rule": "self.minReplicas <= self.maxReplicas", "message": "minReplicas must not exceed maxReplicas"}
        ],
    }


def _spec_schema() -> dict[str, Any]:
    preserve = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "type": "object",
        "required": ["model"],
        "properties": {
            "model": _model_schema(),
            "engine": crd_engine.engine_schema(),
            "image": _str(f"Runtime image. Unset: the operator's (the chart's runtimeImage value; {RUNTIME_IMAGE} "
                          "without the chart)."),
            "resources": {
                "type": "object",
                "description": "Per-pod resources.",
                "properties": {
                    "gpus": _int("GPUs per pod (resource gpuResourceName); also the tensor-parallel size "
                                 "unless engine.tensorParallelSize is set.", 0, Resources().gpus),
                    "cpu": {"x-kubernetes-int-or-string": True, "description": "CPU request, e.g. 4."},
                    "memory": {"x-kubernetes-int-or-string": True, "description": "Memory request and limit, e.g. 32Gi."},
                    **crd_parts.resources_extra(),
                },
            },
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
            "tolerations": {"type": "array", "items": dict(preserve)},
            "affinity": dict(preserve),
            "priorityClassName": _str("PriorityClass of the pods."),
            "replicas": _int("Replicas when autoscaling is off (the scale subresource).", 0,
                             fields.default(InferenceSpec, "replicas")),
            "nodes": multi_node.nodes_schema(),
            "autoscaling": _autoscaling_schema(),
            "service": {
                "type": "object",
                "properties": {
                    "type": _str("Service type.", default=ServiceSpec().type, enum=list(SERVICE_TYPES)),
                    "port": _int("Service port.", 1, ServiceSpec().port, maximum=65535),
                    "annotations": {"type": "object", "additionalProperties": {"type": "string"},
                                    "description": "Service annotations, e.g. an internal load balancer "
                                                   "(networking.gke.io/load-balancer-type: Internal, "
                                                   "service.beta.kubernetes.io/aws-load-balancer-scheme)."},
                },
            },
            "apiKeySecretRef": {
                "type": "object",
                "description": "Secret with the API key clients (and the operator) must send.",
                "required": ["name"],
                "properties": {"name": _str("Secret name."),
                               "key": _str("Key in the Secret.", default=fields.default(SecretRef, "key"))},
            },
            "metricsApiKeySecretRef": {
                "type": "object",
                "description": "Secret with the key GET /metrics requires (the pods' INFLIGHT_METRICS_API_KEY): "
                               "give Prometheus this token instead of the inference key; the admin key (the "
                               "operator's autoscaler) is accepted too. Not with inferencePool (its endpoint "
                               "picker sends no key).",
                "required": ["name"],
                "properties": {"name": _str("Secret name."),
                               "key": _str("Key in the Secret.", default=fields.default(MetricsKeyRef, "key"))},
            },
            "drainTimeoutSeconds": _int("Runtime drain timeout on shutdown (grace period follows it).", 0,
                                        fields.default(InferenceSpec, "drain_timeout_seconds")),
            **crd_parts.pod_properties(),
            "adapters": crd_parts.adapters_schema(),
        },
        "x-kubernetes-validations": [{
            "rule": "!has(self.engine) || !has(self.engine.tensorParallelSize) || !has(self.resources) || "
                    "!has(self.resources.gpus) || self.resources.gpus == 0 || "
                    "self.engine.tensorParallelSize == self.resources.gpus",
            "message": "engine.tensorParallelSize must equal resources.gpus (leave it unset to follow gpus)",
        }, {
            "rule": "!has(self.metricsApiKeySecretRef) || !has(self.inferencePool) || "
                    "!has(self.inferencePool.enabled) || !self.inferencePool.enabled",
            "message": "metricsApiKeySecretRef would close /metrics to the InferencePool's endpoint picker, "
                       "which sends no key",
        }],
    }


def _status_schema() -> dict[str, Any]:
    def num(desc: str) -> dict[str, Any]:
        return {"type": "number", "description": desc}

    return {
        "type": "object",
        "properties": {
            "replicas": {"type": "integer"},
            "readyReplicas": {"type": "integer"},
            "desiredReplicas": {"type": "integer"},
            "selector": {"type": "string"},
            "model": {"type": "string"},
            "endpoint": {"type": "string"},
            "kvCacheUsage": num("Mean KV-cache usage over ready pods at the last scrape."),
            "queueDepth": num("Mean waiting requests per ready pod at the last scrape."),
            "ttftBacklogSeconds": num("Mean seconds of TTFT backlog per ready pod at the last scrape (with "
                                      "spec.autoscaling.targetTtftSeconds; unset before a pod measured a "
                                      "prefill rate)."),
            "lastScaleTime": {"type": "string", "format": "date-time"},
            "recommendations": {
                "type": "array",
                "description": "The autoscaler's recommendations inside its stabilization windows, kept here so "
                               "an operator restart does not forget a scale-down window.",
                "items": {"type": "object", "properties": {
                    "time": {"type": "string", "format": "date-time"}, "replicas": {"type": "integer"},
                    "reason": {"type": "string", "description": "Why: the signal that won (e.g. ScaleUpTtft)."},
                    "message": {"type": "string",
                                "description": "Every signal's value and target at that recommendation."}}},
            },
            "autoscalingBaseReplicas": {
                "type": "integer",
                "description": "spec.replicas when autoscaling was turned on; a later change of spec.replicas "
                               "(kubectl scale, an HPA, KEDA) is ignored and sets AutoscalingConflict.",
            },
            "lastDecisionReason": {"type": "string"},
            "lastDecisionMessage": {"type": "string"},
            "observedGeneration": {"type": "integer"},
            **crd_parts.status_properties(),
            "conditions": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "status"],
                    "properties": {
                        "type": {"type": "string"},
                        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                        "reason": {"type": "string"},
                        "message": {"type": "string"},
                        "lastTransitionTime": {"type": "string", "format": "date-time"},
                        "observedGeneration": {"type": "integer"},
                    },
                },
            },
        },
    }


def _printer_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Model", "type": "string", "jsonPath": ".status.model"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
        {"name": "KV", "type": "number", "jsonPath": ".status.kvCacheUsage"},
        {"name": "Queue", "type": "number", "jsonPath": ".status.queueDepth"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def build_crd() -> dict[str, Any]:
    """The whole CRD as a dict."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": KIND.lower(), "shortNames": ["infd"]},
            "versions": [
                {
                    "name": API_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {
                        "type": "object",
                        "description": "An LLM served by inflight runtime pods, autoscaled on KV usage and queue.",
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "metadata": {"type": "object"},
                            "spec": _spec_schema(),
                            "status": _status_schema(),
                        },
                    }},
                    "subresources": {
                        "status": {},
                        "scale": {"specReplicasPath": ".spec.replicas",
                                  "statusReplicasPath": ".status.replicas",
                                  "labelSelectorPath": ".status.selector"},
                    },
                    "additionalPrinterColumns": _printer_columns(),
                }
            ],
        },
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Writes a schema piece shared by two fields twice instead of as ``&id001``/``*id001``:
    anchors are valid YAML, but kubectl diffs, Helm's own CRD rendering and readers choke on them."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_crd() -> str:
    header = "# Generated by `python -m inflight.operator.crd`; edit inflight/operator/crd.py instead.\n"
    return header + yaml.dump(build_crd(), Dumper=_NoAliasDumper, sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(dump_crd())
