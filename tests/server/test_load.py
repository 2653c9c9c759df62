"""Load behaviour of a live server: a burst of streams respects max_num_sequences and the KV
cache drains back to empty, clients that drop mid-request are aborted (no leaked blocks), and
overload past max_queue_len answers 429 + Retry-After (never 500) while /health stays up."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from tests.server.server_helpers import MAIN_CONFIG, MODEL_NAME, LiveServer, burst, http, is_idle, metrics, wait_until

RUNNING = f'inflight:num_requests_running{{model_name="{MODEL_NAME}"}}'
WAITING = f'inflight:num_requests_waiting{{model_name="{MODEL_NAME}"}}'
KV = f'inflight:kv_cache_usage_perc{{model_name="{MODEL_NAME}"}}'
GENERATED = f'inflight:generation_tokens_total{{model_name="{MODEL_NAME}"}}'
SLOW_STEP_MS = 20  # the injected step time: what keeps requests in flight, not the engine's speed


def body(max_tokens: int, stream: bool, prompt: str = "def fib(n):") -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}


@pytest.fixture(scope="module")
def slow_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    """The shared server's engine config with every step slowed by an injected fault, so that
    requests stay in flight while the test samples /metrics or drops clients, however fast
    the engine is."""
    live = LiveServer(demo_model_dir, EngineConfig(**MAIN_CONFIG), ServerSettings(model_name=MODEL_NAME),
                      fault=f"slow-steps:{SLOW_STEP_MS}").start()
    yield live
    live.stop()


def test_burst_respects_batch_limit_and_drains(slow_server: LiveServer) -> None:
    chunks, samples = asyncio.run(asyncio.wait_for(burst(slow_server.url, 16, 48), 90))
    assert all(c >= 1 for c in chunks)
    running = [s[RUNNING] for s in samples]
    assert max(running) <= 4  # max_num_sequences
    assert max(running) >= 1 and max(s[WAITING] for s in samples) > 0
    assert max(s[KV] for s in samples) > 0
    assert wait_until(lambda: is_idle(slow_server.url), 10)


async def _drop_after_first_chunk(session: aiohttp.ClientSession, url: str, i: int) -> None:
    async with session.post(f"{url}/v1/completions", json=body(400, True, f"# drop {i}\n")) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                break
        resp.close()  # closes the connection: the server sees the client go away


async def _drop_before_answer(url: str, i: int) -> None:
    # Two choices of 480 tokens each: 480 steps of at least SLOW_STEP_MS each (the injected
    # fault), so the client's 0.1 s timeout always fires first, however fast the engine is.
    timeout = aiohttp.ClientTimeout(total=0.1)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            request = {**body(480, False, f"# wait {i}\n"), "n": 2}
            async with session.post(f"{url}/v1/completions", json=request) as resp:
                pytest.fail(f"a 2 x 480-token request should outlast a 0.1 s client timeout; got {resp.status} "
                            f"{(await resp.read())[:300]!r}")
        except asyncio.TimeoutError:
            pass


async def _drop_all(url: str) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(
            *[_drop_after_first_chunk(session, url, i) for i in range(20)],
            *[_drop_before_answer(url, i) for i in range(5)],
        )


def test_dropped_clients_are_aborted_and_free_their_blocks(
    slow_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    url = slow_server.url
    generated_before = metrics(url)[GENERATED]
    with caplog.at_level(logging.INFO, logger="inflight.server.requests"):
        asyncio.run(asyncio.wait_for(_drop_all(url), 90))
        assert wait_until(lambda: is_idle(url), 15), metrics(url)
    outcomes = [json.loads(r.getMessage())["outcome"] for r in caplog.records
                if r.name == "inflight.server.requests"]
    assert outcomes.count("aborted") == 25, outcomes
    # 25 requests of 400-960 tokens would generate 12800 tokens if nobody aborted them.
    assert metrics(url)[GENERATED] - generated_before < 2500
    ok = http("POST", f"{url}/v1/completions", body(8, False))
    assert ok.status == 200 and ok.json()["usage"]["completion_tokens"] == 8


@pytest.fixture(scope="module")
def small_queue_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(
        demo_model_dir,
        EngineConfig(max_num_sequences=2, max_queue_len=2, num_kv_blocks=64, max_model_len=256),
        ServerSettings(model_name=MODEL_NAME),
        fault=f"slow-steps:{SLOW_STEP_MS}",  # the queue fills however fast the engine drains it
    ).start()
    yield live
    live.stop()


async def _overload(url: str, num_requests: int) -> tuple[list[tuple[int, str | None]], list[int]]:
    health: list[int] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def poll_health() -> None:
            while not stop.is_set():
                async with session.get(f"{url}/health") as resp:
                    health.append(resp.status)
                await asyncio.sleep(0.01)

        async def one(i: int) -> tuple[int, str | None]:
            async with session.post(f"{url}/v1/completions", json=body(48, False, f"# {i}\n")) as resp:
                await resp.read()
                return resp.status, resp.headers.get("Retry-After")

        poller = asyncio.create_task(poll_health())
        results = await asyncio.gather(*[one(i) for i in range(num_requests)])
        stop.set()
        await poller
    return list(results), health


def test_overload_gets_429_with_retry_after_and_never_500(small_queue_server: LiveServer) -> None:
    url = small_queue_server.url
    results, health = asyncio.run(asyncio.wait_for(_overload(url, 24), 90))
    statuses = [status for status, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) > 0 and statuses.count(200) >= 2
    assert all(retry is not None and int(retry) >= 1 for status, retry in results if status == 429)
    assert health and set(health) == {200}
    rejected = metrics(url)[f'inflight:request_rejected_total{{model_name="{MODEL_NAME}",reason="queue_full"}}']
    assert rejected == statuses.count(429)
    after = http("POST", f"{url}/v1/completions", body(8, False))
    assert after.status == 200 and after.json()["choices"][0]["finish_reason"] == "length"
    assert wait_until(lambda: is_idle(url), 10)
