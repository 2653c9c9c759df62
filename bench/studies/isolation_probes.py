"""Clients and workloads for :mod:`bench.studies.isolation`: a victim stream's inter-token gaps,
a ``/health`` poller, the ambiguous grammar, large JSON schemas, and the in-process 100k-character
tool-call parse. Knows nothing about reports or which server runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Earley over this grammar is ambiguous (every split of the output is a parse): each mask costs
# more as the output grows, ~1 s per row after ~130 tokens on the bench model's 4096-token vocabulary.
AMBIGUOUS_GRAMMAR = 'start: x\nx: x x x x | x x x | x x | "a" | "b" | "c" | "aa" | "ab" | "abc"\n'
HEALTH_EVERY_S = 0.01


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def stream_gaps(session: aiohttp.ClientSession, url: str, tokens: int) -> list[float]:
    """A greedy completion stream of ``tokens`` tokens: seconds between its chunks after the first."""
    body = {"model": "bench", "prompt": "def victim():", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = []
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        async for raw in resp.content:
            if raw.startswith(b"data: {"):
                times.append(time.monotonic())
    return [b - a for a, b in zip(times, times[1:], strict=False)]


@dataclass(slots=True)
class HealthPoll:
    latencies: list[float] = field(default_factory=list)
    failures: int = 0


@contextlib.asynccontextmanager
async def health_poller(session: aiohttp.ClientSession, url: str) -> AsyncIterator[HealthPoll]:
    """GET /health every ``HEALTH_EVERY_S`` while the block runs; each answer's latency."""
    poll = HealthPoll()

    async def loop() -> None:
        while True:
            t0 = time.monotonic()
            try:
                async with session.get(f"{url}/health") as resp:
                    await resp.read()
                    ok = resp.status == 200
            except aiohttp.ClientError:
                ok = False
            poll.latencies.append(time.monotonic() - t0)
            poll.failures += not ok
            await asyncio.sleep(HEALTH_EVERY_S)

    task = asyncio.create_task(loop())
    try:
        yield poll
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def wide_schema(num_props: int, salt: int) -> dict[str, Any]:
    """A distinct object schema of ``num_props`` optional properties (``salt`` makes it distinct)."""
    kinds = ({"type": "integer"}, {"type": "string", "maxLength": 8}, {"type": "boolean"}, {"type": "number"})
    return {"type": "object", "properties": {f"s{salt}_p{i}": kinds[(i + salt) % 4] for i in range(num_props)}}


def parser_100k(chars: int = 100_000, delta: int = 4) -> dict[str, float]:
    """The front end's streamed tool-call parser fed ``<tool_call>x``, spaces, ``y`` (``chars``
    characters) in ``delta``-character pieces: total and largest per-delta milliseconds."""
    from inflight.runtime.server.openai.tool_stream import ToolStream

    text = "<tool_call>x" + " " * (chars - 13) + "y"
    stream = ToolStream("hermes", None)
    worst, t0 = 0.0, time.perf_counter()
    for start in range(0, len(text), delta):
        t = time.perf_counter()
        stream.feed(text[start:start + delta], start + delta >= len(text))
        worst = max(worst, time.perf_counter() - t)
    return {"chars": len(text), "total_ms": 1e3 * (time.perf_counter() - t0), "max_delta_ms": 1e3 * worst,
            "scanned": stream.scanned}
