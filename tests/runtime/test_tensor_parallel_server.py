"""A real ``inflight serve --tensor-parallel-size 2`` subprocess, through the openai client.

Concurrent greedy completions (chunked context under a small token budget, a KV cache small
enough to preempt, prompts sharing a prefix) return what the offline TP=1 engine returns;
SIGTERM drains and leaves no worker behind; a SIGKILLed worker while clients wait makes
``/health`` and ``/ready`` say 503 and the server exit non-zero with every client answered (an
idle server exits too); and a SIGKILLed front end leaves neither its engine core nor a worker behind.

No timing: the death is injected (SIGKILL) once the event it must meet has happened (every
stream has its first token), and every wait after it is bounded by :data:`PATIENCE_S`, which
only guards against a hang (the server notices a dead worker at its next step or monitor
tick, ~1 s on an idle machine).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from inflight.runtime.engine_faults import FAULT_ENV
from inflight.runtime.llm import LLM
from inflight.runtime.sampling_params import SamplingParams
from tests.server.server_helpers import ServeProcess, http, is_idle, metrics, wait_until

from .hf_reference import CORPUS

openai = pytest.importorskip("openai")  # absent on a bare GPU machine (docs/gpu.md)

MODEL = "demo"
ADMIN_KEY = "tp-admin-key"
ENGINE_ARGS = ["--num-kv-blocks", "14", "--max-num-tokens", "32", "--max-num-sequences", "8", "--max-model-len", "224"]
# Every step sleeps this long: requests stay in flight while a test samples /metrics or kills a
# worker, however fast the engine is.
SLOW_STEPS = "slow-steps:20"
PATIENCE_S = 120.0  # a hang guard, never a claim about speed
# The killed-worker streams: each would need this many slow steps (>= 18 s of injected sleep) to
# finish, so all 8 are still streaming when the worker is killed, however slow the machine is
# at getting the last one its first token (its prefill takes ~15 steps).
KILL_MAX_TOKENS = 900
KILL_ARGS = ["--num-kv-blocks", "576", "--max-model-len", "1024"]  # 8 x (prompt + 900) tokens, no preemption
PROMPTS = [CORPUS[: 40 + 23 * i] for i in range(8)] + [CORPUS[:120] + tail for tail in ("x = 1", "def f():")]


def _processes() -> dict[int, tuple[int, bytes]]:
    """pid -> (parent pid, command line) of every process (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            out[int(entry.name)] = (ppid, (entry / "cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    return out


def _descendants(pid: int) -> list[int]:
    procs, found, frontier = _processes(), [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, (ppid, _) in procs.items() if ppid == parent]
        found += children
        frontier += children
    return found


def _worker_pids(server_pid: int) -> list[int]:
    """The tensor-parallel workers under ``server_pid`` (they hang under its engine core)."""
    procs = _processes()
    return [p for p in _descendants(server_pid) if b"inflight.runtime.distributed.worker" in procs.get(p, (0, b""))[1]]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _serve(model_dir: Path, *extra: str, fault: str = "") -> ServeProcess:
    """A TP=2 server; ``fault`` (e.g. ``SLOW_STEPS``) is injected into its engine core."""
    server = ServeProcess(["--model", str(model_dir), "--served-model-name", MODEL, "--port", "0",
                           "--tensor-parallel-size", "2", *ENGINE_ARGS, *extra],
                          env={FAULT_ENV: fault} if fault else None)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


def _client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=PATIENCE_S, max_retries=0)


def test_served_tp2_matches_offline_tp1_and_sigterm_leaves_no_worker(model_factory) -> None:
    model_dir = model_factory("qwen2")
    with LLM(model_dir, num_kv_blocks=14, max_num_tokens=32, max_num_sequences=8, max_model_len=224) as offline:
        want = offline.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0))
    server = _serve(model_dir)
    try:
        workers = _worker_pids(server.proc.pid)
        assert len(workers) == 1
        client = _client(server)

        def complete(prompt: str):
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0.0)

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, PROMPTS))
        for g, w in zip(got, want, strict=True):
            assert g.choices[0].text == w.text
            assert g.usage.completion_tokens == len(w.token_ids)
        server.terminate()
        assert server.proc.wait(PATIENCE_S) == 0, server.log()
        assert wait_until(lambda: not any(_alive(p) for p in workers), PATIENCE_S), "a worker outlived the server"
    finally:
        server.stop()


def test_tp2_live_retune_and_one_kv_usage_for_the_engine(model_factory) -> None:
    """Under TP=2 the admin retune reaches the one scheduler (running never exceeds the new
    max_num_sequences) and /metrics reports one KV usage for the whole model, back to 0 after."""
    server = _serve(model_factory("llama"), "--num-kv-blocks", "64", "--admin-api-key", ADMIN_KEY, fault=SLOW_STEPS)
    try:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        reply = http("POST", f"{server.url}/admin/config", {"max_num_sequences": 2}, headers=admin)
        assert reply.status == 200, reply.text
        assert http("GET", f"{server.url}/admin/config", headers=admin).json()["max_num_sequences"] == 2
        client = _client(server)
        samples: list[dict[str, float]] = []

        def complete(i: int) -> int:
            out = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=60, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            return out.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(complete, i) for i in range(6)]
            while not all(f.done() for f in futures):
                samples.append(metrics(server.url))
            assert [f.result() for f in futures] == [60] * 6
        kv_series = [k for k in samples[0] if k.startswith("inflight:kv_cache_usage_perc{")]
        assert len(kv_series) == 1, kv_series  # one engine, one value (not one per rank)
        assert max(m["inflight:num_requests_running"] for m in samples) <= 2
        assert max(m["inflight:num_requests_waiting"] for m in samples) > 0
        assert max(m["inflight:kv_cache_usage_perc"] for m in samples) > 0
        assert wait_until(lambda: is_idle(server.url), PATIENCE_S)
    finally:
        server.stop()


def test_killed_worker_fails_every_waiting_client_and_the_server_exits(model_factory) -> None:
    server = _serve(model_factory("llama"), *KILL_ARGS, fault=SLOW_STEPS)  # 8 streams stay in flight
    try:
        (worker,) = _worker_pids(server.proc.pid)
        client = _client(server)
        streaming = [threading.Event() for _ in range(8)]

        def stream(i: int) -> str:
            try:
                chunks = client.completions.create(
                    model=MODEL, prompt=PROMPTS[i], max_tokens=KILL_MAX_TOKENS, temperature=0.0, stream=True,
                    extra_body={"ignore_eos": True},
                )
                for _ in chunks:
                    streaming[i].set()
                return "finished"
            except openai.APIStatusError as exc:  # refused at the door
                return f"status {exc.status_code} {(exc.body or {}).get('code')}"
            except openai.APIError as exc:  # an error event inside the stream (a cut connection has no body)
                return f"error {exc.body.get('code') if isinstance(exc.body, dict) else type(exc).__name__}"

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream, i) for i in range(8)]
            for i, started in enumerate(streaming):
                assert started.wait(PATIENCE_S) or futures[i].done(), f"stream {i} never got a token"
            assert not any(f.done() for f in futures), [f.result() for f in futures if f.done()]
            assert _in_flight(server) == 8
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            assert wait_until(lambda: _health(server) != 200 and _health(server, "/ready") != 200, PATIENCE_S), \
                f"/health or /ready still 200 after the worker died; the server's stacks and log:\n{server.stacks()}"
            code = server.proc.wait(PATIENCE_S)
            elapsed = time.monotonic() - killed
            answers = [f.result(timeout=PATIENCE_S) for f in futures]
    finally:
        server.stop()
    print(f"\nworker SIGKILL -> server exit code {code} after {elapsed:.2f} s; clients: {answers}")
    assert code != 0
    # Every stream was in flight: each gets the engine_dead error event, never a silent cut.
    assert answers == ["error engine_dead"] * 8, answers
    assert "rank 1" in server.log() and "SIGKILL" in server.log()


def test_killed_worker_ends_a_core_whose_step_never_returns(model_factory) -> None:
    """The engine thread blocked in a step (here an injected stall; in the wild a collective with
    the dead rank that never returns) cannot notice a dead worker: the launcher's monitor ends the
    engine-core process after its grace, so the server goes unhealthy, answers the stream in
    flight with engine_dead and exits non-zero, long before the stall watchdog would (an hour)."""
    server = _serve(model_factory("llama"), *KILL_ARGS, "--engine-stall-timeout", "3600",
                    fault="stall-after-steps:3")  # step 1 streams the first token, step 4 never returns
    try:
        (worker,) = _worker_pids(server.proc.pid)
        client = _client(server)
        first = threading.Event()

        def stream() -> str:
            try:
                chunks = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=KILL_MAX_TOKENS,
                                                   temperature=0.0, stream=True, extra_body={"ignore_eos": True})
                for _ in chunks:
                    first.set()
                return "finished"
            except openai.APIError as exc:
                return f"error {exc.body.get('code') if isinstance(exc.body, dict) else type(exc).__name__}"

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(stream)
            assert first.wait(PATIENCE_S), "the stream never got a token"
            assert wait_until(lambda: "stalling the engine thread" in server.log(), PATIENCE_S)
            os.kill(worker, signal.SIGKILL)
            assert wait_until(lambda: _health(server) != 200 and _health(server, "/ready") != 200, PATIENCE_S), \
                f"/health or /ready still 200 after the worker died; the server's stacks and log:\n{server.stacks()}"
            code = server.proc.wait(PATIENCE_S)
            got = answer.result(timeout=PATIENCE_S)
    finally:
        server.stop()
    assert code != 0
    assert got == "error engine_dead", got
    log = server.log()
    assert "rank 1" in log and "SIGKILL" in log and "still blocked in a step" in log


def test_killed_worker_of_an_idle_server_exits_it(model_factory) -> None:
    server = _serve(model_factory("llama"))
    try:
        (worker,) = _worker_pids(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        code = server.proc.wait(PATIENCE_S)
    finally:
        server.stop()
    assert code != 0, code
    assert "rank 1" in server.log() and "SIGKILL" in server.log()


def test_a_killed_front_end_leaves_no_engine_core_and_no_worker(model_factory) -> None:
    """SIGKILL the front end (no drain, no goodbye): the engine core dies with it
    (``PR_SET_PDEATHSIG``) and the worker, re-parented, sees it and exits (it polls its
    parent pid). Nothing is left behind; the wait is bounded, never a timing assertion."""
    server = _serve(model_factory("llama"))
    try:
        (worker,) = _worker_pids(server.proc.pid)
        core = _processes()[worker][0]  # the workers hang under the engine core
        assert core != server.proc.pid and _alive(core)
        assert f"engine core (pid {core})" in server.log(), server.log()
        started = _descendants(server.proc.pid)  # the core, the worker, multiprocessing's resource tracker
        assert {core, worker} <= set(started)
        server.proc.kill()
        server.proc.wait(PATIENCE_S)
        gone = wait_until(lambda: not any(_alive(pid) for pid in started), PATIENCE_S)
        left = {pid: _processes().get(pid, (0, b""))[1][:80] for pid in started if _alive(pid)}
        assert gone, f"left behind after the front end was SIGKILLed: {left} (core {core}, worker {worker})"
    finally:
        server.stop()


def _in_flight(server: ServeProcess) -> float:
    m = metrics(server.url)
    return m["inflight:num_requests_running"] + m["inflight:num_requests_waiting"]


def _health(server: ServeProcess, probe: str = "/health") -> int:
    try:
        return http("GET", f"{server.url}{probe}", timeout=PATIENCE_S).status
    except OSError:
        return 0  # the process is gone: not healthy either

