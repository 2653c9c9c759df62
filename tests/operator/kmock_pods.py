"""Fake runtime pods for the emulator tests: ``FakePod``, an HTTP stand-in on 127.0.0.1 serving
``/metrics`` and recording ``POST /admin/config``, and ``pod_object``, the Pod object the API
server would show for it. Knows nothing about the operator's handlers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp.web

from inflight.operator import render


@dataclass
class FakePod:
    """A runtime stand-in on 127.0.0.1: serves /metrics, /health, /ready; records POST /admin/config."""

    kv_cache_usage: float = 0.0
    num_waiting: float = 0.0
    admin_posts: list[tuple[dict[str, Any], str | None]] = field(default_factory=list)
    port: int = 0
    _runner: aiohttp.web.AppRunner | None = None

    async def start(self) -> FakePod:
        app = aiohttp.web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/admin/config", self._admin)
        self._runner = aiohttp.web.AppRunner(app)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: aiohttp.web.Request) -> aiohttp.web.Response:
        text = (
            "# TYPE inflight:kv_cache_usage_perc gauge\n"
            f'inflight:kv_cache_usage_perc{{model_name="m"}} {self.kv_cache_usage}\n'
            "# TYPE inflight:num_requests_waiting gauge\n"
            f'inflight:num_requests_waiting{{model_name="m"}} {self.num_waiting}\n'
        )
        return aiohttp.web.Response(text=text)

    async def _admin(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.admin_posts.append((await request.json(), request.headers.get("Authorization")))
        return aiohttp.web.json_response({})


def pod_object(name: str, instance: str, port: int, ns: str = "default", ready: bool = True) -> dict[str, Any]:
    """A Pod as the API server would show it, pointing at 127.0.0.1:port (its container port
    named ``http``, as the operator renders it). The ``prometheus.io/port`` annotation is what
    a mesh (Istio's metrics merging) leaves there: the operator must not follow it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name, "namespace": ns, "labels": render.common_labels(instance),
            "annotations": {"prometheus.io/port": "15020"},
        },
        "spec": {"containers": [{"name": "runtime", "image": "x",
                                 "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}]}]},
        "status": {
            "phase": "Running", "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }
