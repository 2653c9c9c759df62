"""The activator's HTTP side: the proxy route, the operator's report endpoint, the prober.

Routes: ``* /{namespace}/{name}/{path}`` forwards to that InferenceDeployment's Service
(``Limits.backend_template``), streaming the answer through chunk by chunk (SSE included);
while the backend is not ready the request is held (``holding``) and answered once a probe of
the backend's ``/ready`` succeeds, or 503 + ``Retry-After`` past the wait bound or the queue
bound (OpenAI's error format). A forward that cannot connect (the last pod just went) marks the
backend not ready and holds the request again: nothing was sent, so nothing is lost or sent
twice. ``POST /activator/backends/{namespace}/{name}`` (the operator, every tick) sets the
backend's port and replicas and answers its demand. ``GET /healthz`` for the kubelet. One
housekeeping loop (on the injected clock) expires held requests and probes, per backend, only
while something is held: no probe traffic while idle. Knows nothing about Kubernetes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from inflight.operator.activator.clock import Clock
from inflight.operator.activator.holding import DNS_LABEL, Backend, Backends, Held, Limits

MAX_BODY_BYTES = 32 * 1024 * 1024
PROBE_TIMEOUT_S = 2.0
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length"})


def error(status: int, message: str, err_type: str, code: str, retry_after_s: int | None = None) -> web.Response:
    """An answer in the OpenAI API's error format."""
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def _forwarded_headers(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


class Activator:
    """The proxy's state: the backends, the clock, one client session and the housekeeping task."""

    def __init__(self, limits: Limits, clock: Clock) -> None:
        self.limits = limits
        self.clock = clock
        self.backends = Backends(limits, clock.now())
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_post("/activator/backends/{namespace}/{name}", self._report)
        app.router.add_route("*", "/{namespace}/{name}/{tail:.*}", self._proxy)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False,
                                              timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        self._spawn(self._housekeeping())

    async def _on_cleanup(self, _: web.Application) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _housekeeping(self) -> None:
        while True:
            await self.clock.sleep(self.limits.probe_interval_s)
            now = self.clock.now()
            for backend in self.backends:
                backend.expire(now)
                self._probe_soon(backend)

    def _probe_soon(self, backend: Backend) -> None:
        if backend.held and not backend.ready and backend.url is not None and not backend.probing:
            backend.probing = True
            self._spawn(self._probe(backend))

    async def _probe(self, backend: Backend) -> None:
        assert self._session is not None and backend.url is not None
        try:
            async with self._session.get(f"{backend.url}/ready",
                                         timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)) as resp:
                if resp.status == 200:
                    backend.set_ready(True)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass  # not up yet: the next housekeeping round probes again while something is held
        finally:
            backend.probing = False

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _report(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        if not DNS_LABEL.match(namespace) or not DNS_LABEL.match(name):
            return error(400, "namespace and name must be DNS labels", "invalid_request_error", "invalid_backend")
        try:
            raw = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error(400, "the body must be JSON: {\"port\": N, \"replicas\": N}", "invalid_request_error",
                         "invalid_body")
        fields = raw if isinstance(raw, dict) else {}
        port, replicas = fields.get("port"), fields.get("replicas")
        if not _is_int(port) or not 1 <= port <= 65535 or not _is_int(replicas) or replicas < 0:
            return error(400, "port must be an integer in 1..65535 and replicas an integer >= 0",
                         "invalid_request_error", "invalid_body")
        now = self.clock.now()
        backend = self.backends.report(namespace, name, port, replicas, now)
        self._probe_soon(backend)
        return web.json_response(backend.demand(now).as_json())

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        backend = None
        if DNS_LABEL.match(namespace) and DNS_LABEL.match(name):
            backend = self.backends.lookup(namespace, name, self.clock.now())
        if backend is None:
            return error(404, f"no InferenceDeployment {namespace}/{name} routes through this activator "
                         "(its autoscaling.minReplicas must be 0); call /<namespace>/<name>/v1/...",
                         "not_found_error", "backend_not_found")
        body = await request.read()
        held: Held | None = None
        try:
            while True:
                if backend.ready and backend.url is not None:
                    answered = await self._forward(request, backend, body)
                    if answered is not None:
                        return answered
                    backend.set_ready(False)  # could not connect: nothing was sent, hold it again
                now = self.clock.now()
                if held is None:
                    held = backend.hold(now, self.limits)
                    if held is None:
                        return error(503, f"{self.limits.max_held} requests are already waiting for "
                                     f"{backend.key} to start; retry later", "service_unavailable_error",
                                     "activator_queue_full", self.limits.retry_after_s)
                elif held.woken.done():
                    held.woken = asyncio.get_running_loop().create_future()
                    if now >= held.deadline:
                        held.woken.set_result(False)
                self._probe_soon(backend)
                if not await held.woken:
                    return error(503, f"{backend.key} did not become ready within "
                                 f"{self.limits.hold_timeout_s:g}s; retry later", "service_unavailable_error",
                                 "activator_timeout", self.limits.retry_after_s)
        finally:
            if held is not None:
                backend.release(held)

    async def _forward(self, request: web.Request, backend: Backend, body: bytes) -> web.StreamResponse | None:
        """The backend's answer, streamed through; None when it could not be reached at all."""
        assert self._session is not None and backend.url is not None
        url = f"{backend.url}/{request.match_info['tail']}"
        if request.query_string:
            url += f"?{request.query_string}"
        backend.start(self.clock.now())
        try:
            try:
                upstream = await self._session.request(request.method, url, data=body,
                                                       headers=_forwarded_headers(request.headers))
            except aiohttp.ClientConnectorError:
                return None
            except aiohttp.ClientError as exc:
                return error(502, f"{backend.key} failed before answering: {exc}", "api_error", "bad_gateway")
            async with upstream:
                answer = web.StreamResponse(status=upstream.status, headers=_forwarded_headers(upstream.headers))
                await answer.prepare(request)
                async for chunk in upstream.content.iter_any():
                    await answer.write(chunk)
                await answer.write_eof()
                return answer
        finally:
            backend.finish(self.clock.now())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
