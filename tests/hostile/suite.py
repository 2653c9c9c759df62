"""The hostile-traffic suite: phases of malformed and poisoned requests against a live server,
with the server's health checked after each phase.

After every phase: ``/health`` answers 200, no request is running or waiting and no KV
block is in use (within a bounded wait), and a greedy reference completion is unchanged.
Across the run it counts distinct malformed requests, right answers (the probe's expected
4xx), 5xx answers, hangs (no answer within ``REQUEST_TIMEOUT_S``) and leaked KV blocks, and
runs a burst of healthy streams with poisoned requests sent among them. Knows nothing about
pytest: ``run`` returns a :class:`Report`, ``python -m tests.hostile`` prints it.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.hostile.strategies import (
    MODEL,
    Probe,
    costly_probes,
    header_probes,
    http_request,
    poison_probes,
    raw_body_probes,
    schema_probes,
    unauthenticated_tokenizer_probes,
)

REQUEST_TIMEOUT_S = 30.0
C_PATH = "/v1/completions"
IDLE_TIMEOUT_S = 30.0
CONCURRENCY = 8
NUM_HEALTHY_STREAMS = 16
STREAM_TOKENS = 24
REFERENCE = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}


@dataclass(slots=True)
class Report:
    """What the suite saw. ``wrong`` lists (probe name, status, body head) of wrong answers."""

    distinct: set[bytes] = field(default_factory=set)
    tried: int = 0
    right: int = 0
    server_errors: int = 0
    hangs: int = 0
    wrong: list[tuple[str, int, str]] = field(default_factory=list)
    leaked_blocks: list[int] = field(default_factory=list)  # per phase, after the idle wait
    reference_unchanged: list[bool] = field(default_factory=list)
    healthy_streams_completed: int = 0
    healthy_streams_matching_clean_run: int = 0
    poison_among_streams: int = 0
    phases: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        return [
            f"malformed requests tried: {self.tried} ({len(self.distinct)} distinct)",
            f"answered right (the expected 4xx; a finished 200 for costly work; a close for half-sent heads): {self.right}",
            f"5xx answers: {self.server_errors}",
            f"hangs: {self.hangs}",
            f"leaked KV blocks after each phase: {self.leaked_blocks}",
            f"greedy reference unchanged after each phase: {self.reference_unchanged}",
            f"healthy streams completed: {self.healthy_streams_completed}/{NUM_HEALTHY_STREAMS} "
            f"(same text as a clean run: {self.healthy_streams_matching_clean_run}) with "
            f"{self.poison_among_streams} poisoned requests sent among them",
            f"phases: {', '.join(self.phases)}; {self.seconds:.1f} s",
            *(f"WRONG: {name} -> {status}: {head}" for name, status, head in self.wrong[:20]),
        ]


async def send_raw(port: int, data: bytes, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes] | None:
    """Send ``data`` on a new connection; (status, body) or ``None`` when no answer came in time.

    Status 0: the server closed the connection without an HTTP answer."""
    async def exchange() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(data)
            await writer.drain()
            raw = await reader.read()
        except ConnectionResetError:
            raw = b""
        finally:
            writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
        return status, body

    try:
        return await asyncio.wait_for(exchange(), timeout)
    except asyncio.TimeoutError:
        return None


async def run_probes(port: int, probes: list[Probe], report: Report) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(probe: Probe) -> None:
        async with gate:
            answer = await send_raw(port, probe.data)
        report.tried += 1
        report.distinct.add(probe.data)
        if answer is None:
            report.hangs += 1
            report.wrong.append((probe.name, -1, "no answer (hang)"))
            return
        status, body = answer
        if status >= 500:
            report.server_errors += 1
        if status in probe.expected and (status == 0 or _is_openai_error(body) or _is_success(status, body)):
            report.right += 1
        else:
            report.wrong.append((probe.name, status, body[:160].decode(errors="replace")))

    await asyncio.gather(*(one(p) for p in probes))


def _is_success(status: int, body: bytes) -> bool:
    """A 200 that finished: a JSON body with choices, or a stream that ends with [DONE] and
    carries no error event."""
    if status != 200:
        return False
    if body.lstrip().startswith(b"data:") or b"\ndata:" in body:
        return b"data: [DONE]" in body and b'"error"' not in body
    try:
        return isinstance(json.loads(body)["choices"], list)
    except (ValueError, KeyError, TypeError):
        return False


def _is_openai_error(body: bytes) -> bool:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and set(error) == {"message", "type", "param", "code"} and len(error["message"]) <= 1000


async def check_health(session: aiohttp.ClientSession, url: str, key: str, reference: str | None,
                       report: Report, phase: str) -> str:
    """The after-phase invariants; returns the reference completion's text."""
    report.phases.append(phase)
    async with session.get(f"{url}/health") as resp:
        assert resp.status == 200, f"/health {resp.status} after {phase}"
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    used = None
    while time.monotonic() < deadline:
        m = await _metrics(session, url, key)
        used = round(m["inflight:kv_cache_usage_perc"] * m["inflight:num_kv_blocks"])
        if used == 0 and m["inflight:num_requests_running"] == 0 and m["inflight:num_requests_waiting"] == 0:
            break
        await asyncio.sleep(0.05)
    report.leaked_blocks.append(int(used or 0))
    async with session.post(f"{url}/v1/completions", json=REFERENCE, headers=_auth(key)) as resp:
        assert resp.status == 200, f"reference completion {resp.status} after {phase}"
        text = (await resp.json())["choices"][0]["text"]
    if reference is not None:
        report.reference_unchanged.append(text == reference)
    return text


async def _metrics(session: aiohttp.ClientSession, url: str, key: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics", headers=_auth(key)) as resp:  # behind the key, as the server has one
        text = await resp.text()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values.setdefault(name.split("{", 1)[0], float(value))
    return values


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _healthy_stream(session: aiohttp.ClientSession, url: str, key: str, i: int) -> tuple[bool, str]:
    body = {"model": MODEL, "prompt": f"# task {i}\ndef f{i}(x):", "max_tokens": STREAM_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    text, finish, done = "", None, False
    async with session.post(f"{url}/v1/completions", json=body, headers=_auth(key)) as resp:
        if resp.status != 200:
            return False, ""
        async for raw in resp.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return False, text
                for choice in chunk["choices"]:
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
    return done and finish == "length", text


async def burst_with_poison(session: aiohttp.ClientSession, url: str, port: int, key: str,
                            report: Report) -> None:
    clean = await asyncio.gather(*(_healthy_stream(session, url, key, i) for i in range(NUM_HEALTHY_STREAMS)))
    poison = poison_probes(key) * 4
    report.poison_among_streams = len(poison)
    streams = [asyncio.create_task(_healthy_stream(session, url, key, i)) for i in range(NUM_HEALTHY_STREAMS)]
    await asyncio.sleep(0.05)
    await run_probes(port, poison, report)
    results = await asyncio.gather(*streams)
    report.healthy_streams_completed = sum(ok for ok, _ in results)
    report.healthy_streams_matching_clean_run = sum(
        ok and text == clean_text for (ok, text), (_, clean_text) in zip(results, clean, strict=True))


def slow_client_probes(key: str) -> list[Probe]:
    """Half-sent heads (closed after the keep-alive timeout, status 0) and half-sent bodies (408)."""
    probes = []
    for i in range(3):
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nX-Slow-{i}: ".encode()
        probes.append(Probe(f"half-sent head {i}", head, frozenset({0})))
    for i in range(3):
        body = b'{"model": "demo", "prompt": "' + b"y" * i
        data = http_request(C_PATH, body, key=key).replace(
            f"Content-Length: {len(body)}".encode(), b"Content-Length: 1000")
        probes.append(Probe(f"half-sent body {i}", data, frozenset({408})))
    return probes


async def vanishing_clients(session: aiohttp.ClientSession, url: str, key: str) -> None:
    """Streams whose client leaves after the first chunk, requests cancelled before the answer."""
    async def leave_stream(i: int) -> None:
        body = {"model": MODEL, "prompt": f"# leave {i}", "max_tokens": 200, "ignore_eos": True,
                "stream": True, "n": 1 + i % 3}
        async with session.post(f"{url}/v1/completions", json=body, headers=_auth(key)) as resp:
            async for _ in resp.content:
                break

    async def cancel_plain(i: int) -> None:
        body = {"model": MODEL, "prompt": f"# cancel {i}", "max_tokens": 200, "ignore_eos": True}
        task = asyncio.create_task(session.post(f"{url}/v1/completions", json=body, headers=_auth(key)))
        await asyncio.sleep(0.05 * (i + 1))
        task.cancel()
        try:
            (await task).close()
        except asyncio.CancelledError:
            pass

    await asyncio.gather(*(leave_stream(i) for i in range(8)), *(cancel_plain(i) for i in range(4)))


async def run(url: str, port: int, key: str, max_examples: int = 150) -> Report:
    """All phases against the server at ``url`` (which needs ``key`` on /v1)."""
    started = time.monotonic()
    report = Report()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        reference = await check_health(session, url, key, None, report, "start")
        phases: list[tuple[str, list[Probe]]] = [
            ("raw bodies", raw_body_probes(key)),
            ("schema (hypothesis)", schema_probes(key, max_examples)),
            ("headers and encodings", header_probes(key) + unauthenticated_tokenizer_probes(key, max_examples)),
            ("costly work", costly_probes(key, max_examples)),
            ("engine poison", poison_probes(key)),
        ]
        for name, probes in phases:
            await run_probes(port, probes, report)
            await check_health(session, url, key, reference, report, name)
        await vanishing_clients(session, url, key)
        await run_probes(port, slow_client_probes(key), report)
        await check_health(session, url, key, reference, report, "vanishing and slow clients")
        await burst_with_poison(session, url, port, key, report)
        await check_health(session, url, key, reference, report, "burst with poison")
    report.seconds = time.monotonic() - started
    return report


def serve_and_run(max_examples: int = 150) -> Report:
    """Make a tiny demo model, serve it on 127.0.0.1 (engine-core process, as in production)
    and run the suite."""
    import tempfile
    from pathlib import Path

    from inflight.runtime.demo.model import make_demo_model
    from tests.server.server_helpers import LiveServer

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_demo_model(Path(tmp) / "demo", size="tiny")
        live = LiveServer(model_dir, hostile_engine_config(), hostile_settings(), engine_process=True).start()
        try:
            return asyncio.run(run(live.url, live.port, API_KEY, max_examples))
        finally:
            live.stop()


API_KEY = "hostile-suite-key"


def hostile_engine_config() -> Any:
    from inflight.runtime.config import EngineConfig

    return EngineConfig(max_num_sequences=8, num_kv_blocks=128, max_model_len=256, max_queue_len=64)


def hostile_settings() -> Any:
    from inflight.runtime.server import ServerSettings

    return ServerSettings(model_name=MODEL, api_key=API_KEY, admin_api_key="hostile-admin-key",
                          max_body_bytes=1024 * 1024, keepalive_timeout_s=2.0, request_read_timeout_s=1.0,
                          stream_write_timeout_s=2.0)
