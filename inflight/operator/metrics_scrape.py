"""Talking to runtime pods over HTTP: scrape /metrics, push live config to /admin/config.

Owns: which pods count as ready, the URL of a pod (``status.podIP`` and the runtime
container's port named ``http``; never the ``prometheus.io/port`` annotation, which a service
mesh rewrites, Istio's metrics merging to 15020), parsing the Prometheus text with prometheus-client's
parser (with the pod's admin key: a runtime with an API key keeps /metrics behind its keys),
and the admin call. Knows nothing about the Kubernetes API or the decision.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from inflight.operator.autoscaler import PodMetrics
from inflight.operator.render import CONTAINER_PORT

KV_METRIC = "inflight:kv_cache_usage_perc"
WAITING_METRIC = "inflight:num_requests_waiting"
# The TTFT-backlog signal's inputs (optional: a runtime without them gives that signal nothing).
PREFILL_BACKLOG_METRIC = "inflight:num_prefill_backlog_tokens"
PREFILL_RATE_METRIC = "inflight:prefill_tokens_per_second"
_SUMMED = (WAITING_METRIC, PREFILL_BACKLOG_METRIC)  # several series (front ends) add up
_READ = (KV_METRIC, WAITING_METRIC, PREFILL_BACKLOG_METRIC, PREFILL_RATE_METRIC)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PodTarget:
    name: str
    base_url: str  # e.g. http://10.0.0.7:8000


def pod_is_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if pod.get("metadata", {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def pod_target(pod: dict[str, Any]) -> PodTarget | None:
    """The pod's runtime URL, or ``None`` while it has no IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = http_port(pod)
    host = f"[{ip}]" if ":" in ip else ip
    return PodTarget(name=pod["metadata"]["name"], base_url=f"http://{host}:{port}")


def http_port(pod: dict[str, Any]) -> int:
    """The runtime container's port named ``http`` (the operator renders it; a sidecar a mesh
    injects has other names), else the port the operator renders by default."""
    containers = (pod.get("spec") or {}).get("containers") or []
    ordered = sorted(containers, key=lambda c: c.get("name") != "runtime")  # the runtime's first
    for container in ordered:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and isinstance(port.get("containerPort"), int):
                return port["containerPort"]
    return CONTAINER_PORT


def read_metrics(text: str) -> dict[str, float]:
    """The autoscaler's metrics present in Prometheus text, by name (summed or the largest)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in _READ:
            continue
        values = [s.value for s in family.samples if s.name == family.name]
        if values:
            found[family.name] = sum(values) if family.name in _SUMMED else max(values)
    return found


def parse_metrics(text: str) -> tuple[float | None, float | None]:
    """(kv_cache_usage, num_waiting) from Prometheus text; a missing metric is ``None``."""
    found = read_metrics(text)
    return found.get(KV_METRIC), found.get(WAITING_METRIC)


def pod_metrics(name: str, text: str) -> PodMetrics:
    """One pod's autoscaling inputs from its /metrics text; a missing metric is ``None``."""
    found = read_metrics(text)
    return PodMetrics(name=name, kv_cache_usage=found.get(KV_METRIC), num_waiting=found.get(WAITING_METRIC),
                      prefill_backlog_tokens=found.get(PREFILL_BACKLOG_METRIC),
                      prefill_tokens_per_second=found.get(PREFILL_RATE_METRIC))


@dataclass(frozen=True, slots=True)
class Scrape:
    metrics: PodMetrics
    error: str | None = None  # "pod at URL: what went wrong"; None when both metrics were read


async def scrape_pod(session: aiohttp.ClientSession, target: PodTarget, timeout_s: float,
                     api_key: str | None = None) -> Scrape:
    """One pod's metrics (``api_key``: its admin key); any failure gives ``None`` values and the error."""
    url = f"{target.base_url}/metrics"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(url, headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            metrics = pod_metrics(target.name, await resp.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        logger.warning("scraping %s at %s failed: %s", target.name, target.base_url, exc)
        return Scrape(PodMetrics(name=target.name, kv_cache_usage=None, num_waiting=None),
                      f"{target.name} at {url}: {exc!r}"[:200])
    missing = [m for m, v in ((KV_METRIC, metrics.kv_cache_usage), (WAITING_METRIC, metrics.num_waiting))
               if v is None]
    error = f"{target.name} at {url}: no {', '.join(missing)}" if missing else None
    return Scrape(metrics, error)


async def scrape_pods(
    session: aiohttp.ClientSession, targets: list[PodTarget], timeout_s: float, api_key: str | None = None
) -> tuple[Scrape, ...]:
    return tuple(await asyncio.gather(*(scrape_pod(session, t, timeout_s, api_key) for t in targets)))


async def push_live_config(
    session: aiohttp.ClientSession,
    target: PodTarget,
    values: dict[str, Any],
    api_key: str | None,
    timeout_s: float,
) -> str | None:
    """POST the live knobs to one pod; ``None`` on success, else an error message."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        url = f"{target.base_url}/admin/config"
        async with session.post(url, json=values, headers=headers, timeout=timeout) as resp:
            if resp.status == 200:
                return None
            return f"{target.name}: HTTP {resp.status}: {(await resp.text())[:200]}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return f"{target.name}: {exc!r}"
