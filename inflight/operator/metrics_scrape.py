"""Talking to runtime pods over HTTP: scrape /metrics, push live config to /admin/config.

Owns: which pods count as ready, the URL of a pod (``status.podIP`` and the
``prometheus.io/port`` annotation, falling back to the container port, so tests can point
a pod object at 127.0.0.1:PORT), parsing the Prometheus text with prometheus-client's
parser, and the admin call. Knows nothing about the Kubernetes API or the decision.
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
    annotations = pod.get("metadata", {}).get("annotations") or {}
    port = annotations.get("prometheus.io/port") or CONTAINER_PORT
    host = f"[{ip}]" if ":" in ip else ip
    return PodTarget(name=pod["metadata"]["name"], base_url=f"http://{host}:{port}")


def parse_metrics(text: str) -> tuple[float | None, float | None]:
    """(kv_cache_usage, num_waiting) from Prometheus text; a missing metric is ``None``."""
    kv: float | None = None
    waiting: float | None = None
    for family in text_string_to_metric_families(text):
        values = [s.value for s in family.samples if s.name == family.name]
        if not values:
            continue
        if family.name == KV_METRIC:
            kv = max(values)
        elif family.name == WAITING_METRIC:
            waiting = sum(values)
    return kv, waiting


async def scrape_pod(session: aiohttp.ClientSession, target: PodTarget, timeout_s: float) -> PodMetrics:
    """One pod's metrics; any failure gives a PodMetrics with ``None`` values."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(f"{target.base_url}/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            kv, waiting = parse_metrics(await resp.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        logger.warning("scraping %s at %s failed: %s", target.name, target.base_url, exc)
        return PodMetrics(name=target.name, kv_cache_usage=None, num_waiting=None)
    return PodMetrics(name=target.name, kv_cache_usage=kv, num_waiting=waiting)


async def scrape_pods(
    session: aiohttp.ClientSession, targets: list[PodTarget], timeout_s: float
) -> tuple[PodMetrics, ...]:
    return tuple(await asyncio.gather(*(scrape_pod(session, t, timeout_s) for t in targets)))


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
