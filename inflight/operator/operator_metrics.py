"""The operator's own Prometheus metrics: reconciles, drift repairs, scrape failures, scaling
decisions and timer errors, on ``INFLIGHT_OPERATOR_METRICS_PORT`` (the chart sets it, 0 or
unset: no endpoint).

Owns the metric objects (in a registry of their own, so tests and a second operator in one
process do not collide) and the HTTP endpoint. Knows nothing about Kubernetes.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from inflight import env_vars

PORT_ENV = "INFLIGHT_OPERATOR_METRICS_PORT"
logger = logging.getLogger(__name__)

REGISTRY = CollectorRegistry()
RECONCILES = Counter(
    "inflight_operator_reconciles", "Reconciles of an InferenceDeployment's children, by result "
    "(applied, invalid_spec, rejected: 400/422, refused: retried).", ["result"], registry=REGISTRY)
DRIFT_REPAIRS = Counter(
    "inflight_operator_drift_repairs", "Children put back by the timer (deleted or edited by hand), by kind.",
    ["kind"], registry=REGISTRY)
SCRAPE_FAILURES = Counter(
    "inflight_operator_scrape_failures", "Runtime pods whose /metrics could not be read in an autoscaling round.",
    registry=REGISTRY)
DECISIONS = Counter(
    "inflight_operator_scaling_decisions", "Autoscaling decisions, by reason (ScaleUpQueue, ScaleDown, "
    "Steady, NoMetrics, ...).", ["reason"], registry=REGISTRY)
TICKS = Counter(
    "inflight_operator_ticks", "Timer rounds started (one per InferenceDeployment per tick).", registry=REGISTRY)
TICK_ERRORS = Counter(
    "inflight_operator_tick_errors", "Timer rounds that raised (kopf retries them).", registry=REGISTRY)
STATUS_WRITES = Counter(
    "inflight_operator_status_writes", "Timer rounds by whether they wrote the status (written) or found "
    "nothing changed (unchanged).", ["result"], registry=REGISTRY)
REFUSALS = Counter(
    "inflight_operator_apply_refusals", "Applies the API server refused, by condition reason (ApplyRefused, "
    "ApplyFailed) and HTTP status (0: no answer).", ["reason", "code"], registry=REGISTRY)
MANAGED = Gauge(
    "inflight_operator_managed_resources", "InferenceDeployments this operator has applied.", registry=REGISTRY)


def start_from_env(environ: dict[str, str] | None = None, addr: str = "0.0.0.0") -> int | None:
    """Serve /metrics on the port the environment names (on every interface of the operator
    pod, for Prometheus); the port, or None when off."""
    raw = (env_vars.read_str(PORT_ENV, environ) or "").strip()
    if not raw or raw == "0":
        return None
    try:
        port = int(raw)
    except ValueError as exc:
        raise ValueError(f"{PORT_ENV} must be a port number (got {raw!r}).") from exc
    if not 1 <= port <= 65535:
        raise ValueError(f"{PORT_ENV} must be in 1..65535 (got {port}).")
    start_http_server(port, addr=addr, registry=REGISTRY)
    logger.info("operator metrics on :%d/metrics", port)
    return port
