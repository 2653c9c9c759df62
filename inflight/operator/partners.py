"""HPA and KEDA as partners: ``spec.autoscaling.partner`` and the signals the operator exports for them.

Owns the partner setting (``Partner``, parsed from ``spec.autoscaling.partner``), the names of
the objects a partner mode puts in the namespace (the HorizontalPodAutoscaler the operator
renders, or KEDA's ScaledObject and the HPA KEDA makes from it, ``keda-hpa-<name>``), and the
per-model gauges the operator serves on its own ``/metrics`` (KV usage, queue depth, TTFT
backlog: the autoscaler's means over the ready pods) that Prometheus scrapes and a metrics adapter
(for an HPA) or KEDA's prometheus scaler reads back. In partner mode the operator still scrapes
and decides every round (status and Events report the signals and what it would do) but never
writes the replicas. Knows nothing about rendering (``render_partners``) or Kubernetes I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Gauge

from inflight.operator.operator_metrics import REGISTRY

KINDS = ("hpa", "keda")
SIGNALS = ("queueDepth", "kvCacheUsage", "ttftBacklogSeconds")
NAMESPACE_LABEL, NAME_LABEL = "infd_namespace", "infd"  # not "namespace": Prometheus sets that to the operator's

KV_CACHE_USAGE = Gauge(
    "inflight_operator_model_kv_cache_usage", "Mean KV-cache usage (0-1) over an InferenceDeployment's ready pods, "
    "as of the operator's last autoscaling round.", [NAMESPACE_LABEL, NAME_LABEL], registry=REGISTRY)
QUEUE_DEPTH = Gauge(
    "inflight_operator_model_queue_depth", "Mean waiting requests per ready pod of an InferenceDeployment.",
    [NAMESPACE_LABEL, NAME_LABEL], registry=REGISTRY)
TTFT_BACKLOG = Gauge(
    "inflight_operator_model_ttft_backlog_seconds", "Mean seconds of TTFT backlog per ready pod (queued prompt "
    "tokens over the measured prefill rate; with spec.autoscaling.targetTtftSeconds).",
    [NAMESPACE_LABEL, NAME_LABEL], registry=REGISTRY)
METRIC_NAMES = {"queueDepth": "inflight_operator_model_queue_depth",
                "kvCacheUsage": "inflight_operator_model_kv_cache_usage",
                "ttftBacklogSeconds": "inflight_operator_model_ttft_backlog_seconds"}


@dataclass(frozen=True, slots=True)
class Partner:
    """Who writes the replicas instead of the operator: an HPA it renders (through a metrics
    adapter serving ``METRIC_NAMES`` as external metrics) or a KEDA ScaledObject (its prometheus
    scaler, querying ``prometheus_address``)."""

    kind: str  # "hpa" | "keda"
    prometheus_address: str = ""  # keda: the Prometheus that scrapes the operator's /metrics


def parse(raw: Any, min_replicas: int, prefix: str = "spec.autoscaling.partner") -> Partner | None:
    """``spec.autoscaling.partner`` (absent or null: the operator writes the replicas itself)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"{prefix} must be an object with kind: hpa or keda (got {raw!r}).")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{prefix}.kind must be one of {', '.join(KINDS)} (got {kind!r}).")
    address = raw.get("prometheusAddress", "")
    if not isinstance(address, str):
        raise ValueError(f"{prefix}.prometheusAddress must be a URL string (got {address!r}).")
    if kind == "keda" and not address.startswith(("http://", "https://")):
        raise ValueError(f"{prefix}.prometheusAddress is required with kind: keda: the http(s) URL of the "
                         "Prometheus that scrapes the operator's /metrics (KEDA's prometheus scaler queries it).")
    if kind == "hpa" and min_replicas < 1:
        raise ValueError(f"{prefix}: an HPA cannot scale to zero (minReplicas {min_replicas}); use kind: keda "
                         "or minReplicas >= 1.")
    return Partner(kind=kind, prometheus_address=address)


def hpa_name(name: str, partner: Partner | None) -> str | None:
    """The HPA that partner mode puts on the model's workload (``None``: no partner)."""
    if partner is None:
        return None
    return name if partner.kind == "hpa" else f"keda-hpa-{name}"


def publish(namespace: str, name: str, kv: float | None, queue: float | None, ttft: float | None) -> None:
    """Set the model's gauges to the last round's signals (a signal not measured: its series is removed)."""
    for gauge, value in ((KV_CACHE_USAGE, kv), (QUEUE_DEPTH, queue), (TTFT_BACKLOG, ttft)):
        if value is None:
            forget(gauge, namespace, name)
        else:
            gauge.labels(namespace, name).set(value)


def forget(gauge: Gauge, namespace: str, name: str) -> None:
    try:
        gauge.remove(namespace, name)
    except KeyError:  # never set
        pass


def unpublish(namespace: str, name: str) -> None:
    """Drop the model's series (the resource is gone, or autoscaling is off)."""
    for gauge in (KV_CACHE_USAGE, QUEUE_DEPTH, TTFT_BACKLOG):
        forget(gauge, namespace, name)
