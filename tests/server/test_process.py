"""Real ``python -m inflight.runtime serve`` processes: the `make run` command line answers the
README's curl, and SIGTERM (and SIGHUP) drains (streams in flight complete, new requests get 503, exit 0
within the drain timeout); SIGUSR1 writes every server process's stacks and changes nothing."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from inflight.runtime.engine_faults import FAULT_ENV
from tests.server.server_helpers import MODEL_NAME, ServeProcess, http, metrics

# With every step slowed to SLOW_STEP_MS (an injected fault), 200 steps keep the streams
# running when SIGTERM lands and the 503 probe is sent, however fast the engine is, and
# finish (4 s of injected sleep) well inside the drain timeout.
STREAM_TOKENS = 200
SLOW_STEP_MS = 20
DRAIN_TIMEOUT_S = 60.0
README_BODY = {"model": "demo", "prompt": "def fib(n):", "max_tokens": 32}


def test_make_run_command_line_answers_the_readme_curl(demo_model_dir: Path) -> None:
    # `make run` is: $(PY) -m inflight.runtime serve --model models/demo --served-model-name demo
    #                --host 127.0.0.1 --port 8000   (here on an ephemeral port)
    server = ServeProcess(["--model", str(demo_model_dir), "--served-model-name", "demo",
                           "--host", "127.0.0.1", "--port", "0"])
    try:
        server.wait_ready()
        url = f"{server.url}/v1/completions"
        if shutil.which("curl"):
            out = subprocess.run(
                ["curl", "-sS", "--max-time", "60", url, "-H", "Content-Type: application/json",
                 "-d", json.dumps(README_BODY)],
                capture_output=True, text=True, timeout=90, check=True,
            ).stdout
            reply = json.loads(out)
        else:
            reply = http("POST", url, README_BODY).json()
        assert reply["object"] == "text_completion" and reply["model"] == "demo"
        assert reply["choices"][0]["text"] and reply["usage"]["completion_tokens"] <= 32
        assert "loading weights" in server.log() or "model loaded" in server.log()  # progress lines
        # SIGUSR1: each server process writes its threads' stacks to the log and goes on serving.
        (front_end, core) = server.server_pids()
        dumped = server.stacks()
        assert dumped.count("(most recent call first):") >= 2, dumped  # at least a thread of each process
        assert "inflight/runtime/engine_core/core.py" in dumped and "inflight/runtime/server/" in dumped, dumped
        assert http("POST", url, README_BODY).json()["choices"][0]["text"]
        assert server.proc.poll() is None and core in server.server_pids()
        server.terminate()
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


async def _stream(session: aiohttp.ClientSession, url: str, i: int, first: asyncio.Event) -> dict[str, Any]:
    request = {"model": MODEL_NAME, "prompt": f"# stream {i}\n", "max_tokens": STREAM_TOKENS, "temperature": 0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, finish, usage, done = "", None, None, False
    async with session.post(f"{url}/v1/completions", json=request) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                first.set()
                for choice in chunk["choices"]:
                    text += choice["text"]
                    finish = choice["finish_reason"] or finish
                usage = chunk.get("usage") or usage
    return {"text": text, "finish": finish, "usage": usage, "done": done}


async def _drain_scenario(server: ServeProcess, sig: signal.Signals) -> tuple[list[dict[str, Any]], list[Any], float]:
    url = server.url
    first = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DRAIN_TIMEOUT_S)) as session:
        streams = [asyncio.create_task(_stream(session, url, i, first)) for i in range(8)]
        await asyncio.wait_for(first.wait(), 30)
        for _ in range(200):  # all 8 admitted into the engine (running or waiting)
            m = await asyncio.to_thread(metrics, url)
            if m["inflight:num_requests_running"] + m["inflight:num_requests_waiting"] == 8:
                break
            await asyncio.sleep(0.02)
        signalled = time.monotonic()
        server.proc.send_signal(sig)
        await asyncio.sleep(0.1)
        refused = []
        for path, body in (("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}),
                           ("/ready", None)):
            method = "POST" if body else "GET"
            async with session.request(method, url + path, json=body) as resp:
                refused.append((resp.status, resp.headers.get("Retry-After"), await resp.json()))
        results = await asyncio.gather(*streams)
    return list(results), refused, signalled


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_drains_streams_in_flight(demo_model_dir: Path, sig: signal.Signals) -> None:
    drain_timeout = DRAIN_TIMEOUT_S
    server = ServeProcess(["--model", str(demo_model_dir), "--served-model-name", MODEL_NAME,
                           "--port", "0", "--max-num-sequences", "8", "--num-kv-blocks", "128",
                           "--drain-timeout", str(drain_timeout)],
                          env={FAULT_ENV: f"slow-steps:{SLOW_STEP_MS}"})
    try:
        server.wait_ready()
        results, refused, signalled = asyncio.run(asyncio.wait_for(_drain_scenario(server, sig), 2 * DRAIN_TIMEOUT_S))
        code = server.proc.wait(drain_timeout + 10)
    finally:
        server.stop()
    assert code == 0, server.log()
    assert "drain complete" in server.log() and "drain timeout" not in server.log()  # finished, never cut
    for r in results:
        assert r["done"] and r["finish"] == "length" and r["usage"]["completion_tokens"] == STREAM_TOKENS
    (gen_status, gen_retry, gen_body), (ready_status, _, ready_body) = refused
    assert gen_status == 503 and gen_retry is not None
    assert gen_body["error"]["code"] == "draining"
    assert ready_status == 503 and ready_body == {"status": "draining"}
