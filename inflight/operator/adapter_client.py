"""The runtime's LoRA admin API as the operator calls it: list, load and unload adapters on one pod.

Owns the three HTTP calls (vLLM's interface): ``GET /v1/models`` (an adapter is an entry with a
``parent``; its ``root`` is the path it was loaded from), ``POST /v1/load_lora_adapter``
{lora_name, lora_path} and ``POST /v1/unload_lora_adapter`` {lora_name}, each with the pod's
admin key. A 400 on load is the runtime refusing the adapter (bad files, rank over the max, a
base-model mismatch): returned as its reason. Anything else that is not a success (no answer,
401, 5xx) raises ``PodCallError``: the pod is retried next tick. Knows nothing about Kubernetes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from inflight.operator.metrics_scrape import PodTarget


class PodCallError(Exception):
    """A pod call without a usable answer (the message names the pod and what happened)."""


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def error_text(body: str) -> str:
    """The message of an OpenAI-format error body, else the body (cut)."""
    try:
        doc: Any = json.loads(body)
    except ValueError:
        return body.strip()[:300]
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:300]
        if isinstance(doc.get("message"), str):
            return doc["message"][:300]
    return body.strip()[:300]


async def _call(session: aiohttp.ClientSession, method: str, target: PodTarget, path: str, key: str | None,
                timeout_s: float, body: dict[str, Any] | None = None) -> tuple[int, str]:
    try:
        async with session.request(method, f"{target.base_url}{path}", json=body, headers=_headers(key),
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status, await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise PodCallError(f"{target.name}: {method} {path}: {exc!r}") from None


async def list_adapters(session: aiohttp.ClientSession, target: PodTarget, key: str | None,
                        timeout_s: float) -> dict[str, str]:
    """The pod's loaded adapters: name -> path."""
    code, text = await _call(session, "GET", target, "/v1/models", key, timeout_s)
    if code != 200:
        raise PodCallError(f"{target.name}: GET /v1/models: HTTP {code}: {error_text(text)}")
    try:
        entries = json.loads(text)["data"]
        return {e["id"]: str(e.get("root") or "") for e in entries if e.get("parent")}
    except (ValueError, KeyError, TypeError) as exc:
        raise PodCallError(f"{target.name}: GET /v1/models: not a model list ({exc!r})") from None


async def load(session: aiohttp.ClientSession, target: PodTarget, name: str, path: str, key: str | None,
               timeout_s: float) -> str | None:
    """Load one adapter: ``None`` when loaded, the runtime's reason when it refused it (400)."""
    code, text = await _call(session, "POST", target, "/v1/load_lora_adapter", key, timeout_s,
                             {"lora_name": name, "lora_path": path})
    if code == 200:
        return None
    if code == 400:
        return error_text(text) or "refused (HTTP 400)"
    raise PodCallError(f"{target.name}: load {name}: HTTP {code}: {error_text(text)}")


async def unload(session: aiohttp.ClientSession, target: PodTarget, name: str, key: str | None,
                 timeout_s: float) -> None:
    """Unload one adapter (already gone, a 404, counts as done)."""
    code, text = await _call(session, "POST", target, "/v1/unload_lora_adapter", key, timeout_s, {"lora_name": name})
    if code not in (200, 404):
        raise PodCallError(f"{target.name}: unload {name}: HTTP {code}: {error_text(text)}")
