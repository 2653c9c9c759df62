"""The activator on its own: held requests answered once the backend turns ready, 503 +
Retry-After past the wait bound and the queue bound, streaming passthrough, a lost backend held
again, unknown backends, the operator's report endpoint. Time is a ``ManualClock``: nothing
here waits on a wall clock; the stand-in backend is a small aiohttp app on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from inflight.operator.activator.app import Activator
from inflight.operator.activator.clock import ManualClock
from inflight.operator.activator.holding import Limits

PROBE_S = 1.0


@dataclass
class FakeBackend:
    """/ready (503 until ``ready``), /v1/completions (echoes the body), /v1/stream (two SSE
    events, the second only once ``release`` is set)."""

    ready: bool = False
    release: asyncio.Event = field(default_factory=asyncio.Event)
    bodies: list[Any] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/stream", self._stream)
        return app

    async def _ready(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.ready else 503)

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        return web.json_response({"object": "text_completion", "echo": body, "q": request.query_string})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: one\n\n")
        await self.release.wait()
        await resp.write(b"data: two\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp


@dataclass
class Rig:
    clock: ManualClock
    activator: Activator
    url: str
    backend: FakeBackend
    backend_port: int
    session: aiohttp.ClientSession

    async def report(self, replicas: int, port: int | None = None, name: str = "m") -> dict[str, Any]:
        async with self.session.post(f"{self.url}/activator/backends/default/{name}",
                                     json={"port": port or self.backend_port, "replicas": replicas}) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()

    async def post(self, path: str, body: Any) -> tuple[int, dict[str, str], Any]:
        async with self.session.post(f"{self.url}{path}", json=body) as resp:
            return resp.status, dict(resp.headers), await resp.json(content_type=None)


async def _site(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


@contextlib.asynccontextmanager
async def rig(**limits: Any) -> AsyncIterator[Rig]:
    clock = ManualClock()
    activator = Activator(Limits(**{"backend_template": "http://127.0.0.1:{port}", "probe_interval_s": PROBE_S,
                                    "registration_grace_s": 0.0, **limits}), clock)
    backend = FakeBackend()
    backend_runner, backend_port = await _site(backend.app())
    runner, port = await _site(activator.app())
    try:
        async with aiohttp.ClientSession() as session:
            yield Rig(clock, activator, f"http://127.0.0.1:{port}", backend, backend_port, session)
    finally:
        backend.release.set()
        await runner.cleanup()
        await backend_runner.cleanup()


async def until(check: Callable[[], Awaitable[bool] | bool], what: str) -> None:
    """Let the event loop run until ``check`` holds (bounded by rounds, not by a clock)."""
    for _ in range(2000):
        value = check()
        if value if isinstance(value, bool) else await value:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


def held(r: Rig, name: str = "m") -> int:
    backend = r.activator.backends.get("default", name)
    return 0 if backend is None else len(backend.held)


BODY = {"model": "demo", "prompt": "hi", "max_tokens": 2}


def test_the_first_request_after_idle_is_held_and_answered_once_the_backend_is_ready() -> None:
    async def scenario() -> None:
        async with rig() as r:
            assert await r.report(replicas=0) == {"held": 0, "inFlight": 0, "idleSeconds": 0.0}
            await r.clock.advance(120)
            assert (await r.report(replicas=0))["idleSeconds"] == 120.0
            call = asyncio.create_task(r.post("/default/m/v1/completions?x=1", BODY))
            await until(lambda: held(r) == 1, "the request is held")
            assert await r.report(replicas=0) == {"held": 1, "inFlight": 0, "idleSeconds": 0.0}  # demand
            await r.clock.advance(PROBE_S)  # probed: not ready yet, still held
            await asyncio.sleep(0.05)
            assert not call.done() and held(r) == 1
            r.backend.ready = True  # the pod passed its readiness probe
            await r.clock.advance(PROBE_S)
            status, _, answer = await asyncio.wait_for(call, 30)
            assert status == 200 and answer["echo"] == BODY and answer["q"] == "x=1"
            assert held(r) == 0 and (await r.report(replicas=1))["held"] == 0

    asyncio.run(scenario())


def test_a_request_held_past_the_wait_bound_gets_503_with_retry_after() -> None:
    async def scenario() -> None:
        async with rig(hold_timeout_s=10.0, retry_after_s=7) as r:
            await r.report(replicas=0)
            call = asyncio.create_task(r.post("/default/m/v1/completions", BODY))
            await until(lambda: held(r) == 1, "the request is held")
            await r.clock.advance(9)
            await asyncio.sleep(0.05)
            assert not call.done()  # 9 s < the 10 s bound
            await r.clock.advance(PROBE_S)
            status, headers, answer = await asyncio.wait_for(call, 30)
            assert status == 503 and headers["Retry-After"] == "7"
            assert answer["error"]["type"] == "service_unavailable_error"
            assert answer["error"]["code"] == "activator_timeout" and "10s" in answer["error"]["message"]
            assert held(r) == 0 and r.backend.bodies == []  # answered, never forwarded

    asyncio.run(scenario())


def test_past_the_queue_bound_503_at_once_and_the_held_ones_still_answered() -> None:
    async def scenario() -> None:
        async with rig(max_held=2) as r:
            await r.report(replicas=0)
            calls = [asyncio.create_task(r.post("/default/m/v1/completions", {**BODY, "i": i})) for i in range(2)]
            await until(lambda: held(r) == 2, "two requests held")
            status, headers, answer = await r.post("/default/m/v1/completions", BODY)
            assert status == 503 and headers["Retry-After"] == "30"
            assert answer["error"]["code"] == "activator_queue_full"
            r.backend.ready = True
            await r.clock.advance(PROBE_S)
            answers = await asyncio.wait_for(asyncio.gather(*calls), 30)
            assert [a[0] for a in answers] == [200, 200]
            assert sorted(b["i"] for b in r.backend.bodies) == [0, 1]

    asyncio.run(scenario())


def test_a_stream_passes_through_chunk_by_chunk() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.backend.ready = True
            await r.report(replicas=1)
            async with r.session.post(f"{r.url}/default/m/v1/stream", json=BODY) as resp:
                assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
                first = await resp.content.readuntil(b"\n\n")
                assert first == b"data: one\n\n"  # here before the backend has sent the rest
                assert r.activator.backends.get("default", "m").in_flight == 1  # type: ignore[union-attr]
                r.backend.release.set()
                assert await resp.content.read() == b"data: two\n\ndata: [DONE]\n\n"
            assert (await r.report(replicas=1))["inFlight"] == 0

    asyncio.run(scenario())


def test_a_backend_gone_to_zero_holds_the_next_request_again() -> None:
    async def scenario() -> None:
        async with rig() as r:
            r.backend.ready = True
            await r.report(replicas=1)
            assert (await r.post("/default/m/v1/completions", BODY))[0] == 200
            r.backend.ready = False
            await r.report(replicas=0)  # the operator scaled it to zero
            call = asyncio.create_task(r.post("/default/m/v1/completions", BODY))
            await until(lambda: held(r) == 1, "held again at zero replicas")
            r.backend.ready = True
            await r.clock.advance(PROBE_S)
            assert (await asyncio.wait_for(call, 30))[0] == 200

    asyncio.run(scenario())


def test_a_backend_that_refuses_connections_holds_instead_of_failing() -> None:
    async def scenario() -> None:
        async with rig(hold_timeout_s=5.0) as r:
            dead_runner, dead_port = await _site(web.Application())
            await dead_runner.cleanup()  # a port nothing listens on: connection refused
            await r.report(replicas=1, port=dead_port)
            r.activator.backends.get("default", "m").ready = True  # type: ignore[union-attr]
            call = asyncio.create_task(r.post("/default/m/v1/completions", BODY))
            await until(lambda: held(r) == 1, "held after the refused connection")
            await r.clock.advance(5)
            status, headers, _ = await asyncio.wait_for(call, 30)
            assert status == 503 and "Retry-After" in headers

    asyncio.run(scenario())


def test_unknown_backends_and_bad_reports() -> None:
    async def scenario() -> None:
        async with rig() as r:
            status, _, answer = await r.post("/default/nobody/v1/completions", BODY)
            assert status == 404 and answer["error"]["code"] == "backend_not_found"
            assert (await r.post("/Bad_NS/m/v1/completions", BODY))[0] == 404
            for bad in ({"port": 0, "replicas": 1}, {"port": 80, "replicas": -1}, {"port": "80", "replicas": 1},
                        {"port": True, "replicas": 1}, [1]):
                async with r.session.post(f"{r.url}/activator/backends/default/m", json=bad) as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_body"
            async with r.session.post(f"{r.url}/activator/backends/default/m", data=b"{") as resp:
                assert resp.status == 400

    asyncio.run(scenario())


def test_within_the_registration_grace_an_unreported_backend_is_held() -> None:
    async def scenario() -> None:
        async with rig(registration_grace_s=30.0) as r:
            call = asyncio.create_task(r.post("/default/m/v1/completions", BODY))
            await until(lambda: held(r) == 1, "held before the operator's first report")
            r.backend.ready = True
            await r.report(replicas=1)  # the report probes at once: something is held
            assert (await asyncio.wait_for(call, 30))[0] == 200

    asyncio.run(scenario())


@pytest.mark.parametrize("limits", [{"max_held": 0}, {"hold_timeout_s": 0}, {"retry_after_s": 0},
                                    {"backend_template": "http://x"}])
def test_limits_are_validated(limits: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Limits(**limits)
