"""One client cannot starve the others: huge bodies are decoded and their prompts tokenized on a worker pool while
/health and small requests keep answering (checked by holding three 3.5 MiB prompts in the
pool, never by timing the answers: how fast /health answers belongs to the benchmarks), and
a client that stops reading its stream loses it and frees its KV blocks."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import aiohttp
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from inflight.runtime.server.state import STATE, ServerState
from tests.server.server_helpers import MODEL_NAME, LiveServer, is_idle, metrics, post_bytes, wait_until

T = TypeVar("T")

HUGE_PROMPT_BYTES = int(3.5 * 1024 * 1024)
NUM_HEALTH_PROBES = 20
GATE_TIMEOUT_S = 120.0  # only so that a failing test cannot leave a pool thread waiting forever


@pytest.fixture(scope="module")
def roomy_server(demo_model_dir: Path) -> Iterator[LiveServer]:
    live = LiveServer(demo_model_dir, EngineConfig(max_num_sequences=4, num_kv_blocks=64, max_model_len=512),
                      ServerSettings(model_name=MODEL_NAME, max_body_bytes=8 * 1024 * 1024,
                                     stream_write_timeout_s=1.0, max_stream_backlog=64)).start()
    yield live
    live.stop()


def _huge_prompt(i: int) -> str:
    words = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
    text = " ".join(words[(i + k) % 8] + str(k % 97) for k in range(HUGE_PROMPT_BYTES // 8))
    return text[:HUGE_PROMPT_BYTES]


async def _huge_prompts_scenario(url: str, state: ServerState, gate: threading.Event) -> tuple[int, int, list[int]]:
    """Three huge prompts held in the tokenizer pool (``gate``) while /health and a small
    request are asked; then released. Returns the /health probes answered while all three
    were held, the small request's status, and the huge prompts' statuses."""
    bodies = [json.dumps({"model": MODEL_NAME, "prompt": _huge_prompt(i), "max_tokens": 4}) for i in range(3)]
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as probe, aiohttp.ClientSession(timeout=timeout) as big:

        async def post(body: str) -> int:
            async with big.post(f"{url}/v1/completions", data=body,
                                headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                return resp.status

        big_posts = [asyncio.create_task(post(b)) for b in bodies]
        while state.num_tokenizing < len(bodies):  # all three handed to the pool, none finished
            assert not any(t.done() for t in big_posts), [t.result() for t in big_posts if t.done()]
            await asyncio.sleep(0.01)
        num_health = 0
        for _ in range(NUM_HEALTH_PROBES):
            async with probe.get(f"{url}/health") as resp:
                assert resp.status == 200
                num_health += 1
        # a small request sent meanwhile is served without waiting for the big ones
        async with probe.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
            small = resp.status
        assert state.num_tokenizing == len(bodies) and not any(t.done() for t in big_posts)
        gate.set()
        # and /health keeps answering while the three really tokenize, side by side
        while not all(t.done() for t in big_posts):
            async with probe.get(f"{url}/health") as resp:
                assert resp.status == 200
            await asyncio.sleep(0.02)
        statuses = await asyncio.gather(*big_posts)
    return num_health, small, list(statuses)


def test_health_answers_while_huge_prompts_tokenize(
    roomy_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = roomy_server.app[STATE]
    gate = threading.Event()
    in_pool = state.in_pool

    async def held_in_pool(fn: Callable[[], T]) -> T:
        def held() -> T:  # runs on a pool thread: holding it there never blocks the event loop
            gate.wait(GATE_TIMEOUT_S)
            return fn()

        return await in_pool(held)

    monkeypatch.setattr(state, "in_pool", held_in_pool)
    try:
        num_health, small, statuses = asyncio.run(
            asyncio.wait_for(_huge_prompts_scenario(roomy_server.url, state, gate), 300))
    finally:
        gate.set()
    assert num_health == NUM_HEALTH_PROBES and small == 200
    assert statuses == [400, 400, 400]  # far past the context: refused, after tokenizing


def test_a_stream_nobody_reads_is_cut_and_its_blocks_freed(roomy_server: LiveServer) -> None:
    url = roomy_server.url
    key = f'inflight:request_success_total{{finished_reason="abort",model_name="{MODEL_NAME}"}}'
    before = metrics(url).get(key, 0)
    body = json.dumps({"model": MODEL_NAME, "prompt": "# never read\n", "max_tokens": 480, "n": 16,
                       "ignore_eos": True, "stream": True, "logprobs": 20}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect(("127.0.0.1", roomy_server.port))
        sock.sendall(post_bytes("/v1/completions", body))
        # the client never reads: its stream is cut and every choice aborted, KV blocks freed,
        # while the connection is still open
        assert wait_until(lambda: metrics(url).get(key, 0) >= before + 8, 90)  # most of the 16 choices
        assert wait_until(lambda: is_idle(url), 30)
    finally:
        sock.close()
