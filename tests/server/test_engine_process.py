"""``inflight serve`` runs the engine in an engine-core process of its own. Supervision across
the boundary: the core killed while clients wait (every client answered, /health 503, exit 1,
nothing left behind); the front end killed (the core exits too); a core whose step stalls
(the watchdog kills it); a core that cannot load; a start refused by the front end's checks or
by the core's own read of the model (the core, started early, is gone and loaded nothing); a
core that dies before it says what it read. And the split changes no output: greedy text
equals ``--single-process``'s, and the front end never loads torch."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from test_supervision import _clients

from inflight.runtime.cli.command import main
from inflight.runtime.config import EngineConfig
from inflight.runtime.engine_core.core import CoreLaunch
from inflight.runtime.engine_faults import FAULT_ENV
from inflight.runtime.llm import LLM
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server import engine_process
from inflight.runtime.server.state import ServerSettings
from tests.server.server_helpers import MODEL_NAME, LiveServer, ServeProcess, http, metrics, wait_until

PATIENCE_S = 120.0  # a hang guard for process exits, never a claim about speed
# The watchdog's limit where a stall is injected: the injected step never returns, so any limit
# catches it; this one is far past any real step of the demo model, however loaded the machine
# (a 2 s limit was once reached by a healthy step before the injected one).
STALL_TIMEOUT_S = 20.0
BASE = ["--served-model-name", MODEL_NAME, "--port", "0", "--max-num-sequences", "2", "--num-kv-blocks", "64",
        "--max-model-len", "512"]  # fmt: skip


def _serve(demo_model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> ServeProcess:
    return ServeProcess(["--model", str(demo_model_dir), *BASE, *extra], env=env)


def _core_pid(server: ServeProcess) -> int:
    match = re.search(r"engine core \(pid (\d+)\)", server.log())
    assert match, server.log()
    return int(match.group(1))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; only its exit status is left


def _answered_and_exited(server: ServeProcess, kill) -> tuple[list[str], list[tuple[int, str | None]], int, float]:  # noqa: ANN001
    """Clients in flight on a core stalled by the injected fault, then ``kill()``."""
    async def scenario() -> tuple[list[str], list[tuple[int, str | None]]]:
        clients = asyncio.create_task(_clients(server.url, 2, 2))
        while "stalling the engine thread" not in server.log():  # frozen mid-generation
            await asyncio.sleep(0.02)
        kill()
        return await clients

    streams, plain = asyncio.run(asyncio.wait_for(scenario(), PATIENCE_S))
    answered = time.monotonic()
    code = server.proc.wait(PATIENCE_S)
    return streams, plain, code, time.monotonic() - answered


def test_a_killed_engine_core_answers_every_client_and_exits_non_zero(demo_model_dir: Path) -> None:
    server = _serve(demo_model_dir, env={FAULT_ENV: "stall-after-steps:20"})  # the watchdog waits 300 s
    try:
        server.wait_ready()
        core = _core_pid(server)
        streams, plain, code, exited_after = _answered_and_exited(server, lambda: os.kill(core, signal.SIGKILL))
    finally:
        server.stop()
    assert all(s in ("error:engine_dead", "status:503:engine_dead") for s in streams), streams
    assert all(p == (503, "engine_dead") for p in plain), plain
    assert code == 1, server.log()
    print(f"engine core SIGKILLed: exit code {code}, {exited_after:.2f} s after every client was answered")
    assert "the engine core process exited" in server.log()


def test_a_killed_front_end_takes_the_engine_core_with_it(demo_model_dir: Path) -> None:
    server = _serve(demo_model_dir)
    try:
        server.wait_ready()
        core = _core_pid(server)
        assert _alive(core)
        server.proc.kill()
        server.proc.wait(PATIENCE_S)
        assert wait_until(lambda: not _alive(core), PATIENCE_S), "the engine core outlived its front end"
    finally:
        server.stop()


def test_a_stalled_core_is_killed_by_the_watchdog(demo_model_dir: Path) -> None:
    """The injected stall (a step that never returns, after 20 healthy ones) is what the watchdog
    catches: no healthy step comes near its limit, and nothing here is timed."""
    server = _serve(demo_model_dir, "--engine-stall-timeout", str(STALL_TIMEOUT_S),
                    env={FAULT_ENV: "stall-after-steps:20"})  # fmt: skip
    try:
        server.wait_ready()
        core = _core_pid(server)
        streams, plain, code, _ = _answered_and_exited(server, lambda: None)
        assert wait_until(lambda: not _alive(core), PATIENCE_S), "the stalled engine core was left running"
    finally:
        server.stop()
    assert all(s in ("error:engine_dead", "status:503:engine_dead") for s in streams), streams
    assert all(p == (503, "engine_dead") for p in plain), plain
    assert code == 1 and "stall timeout" in server.log(), server.log()


def test_a_core_that_cannot_load_exits_with_its_reason(demo_model_dir: Path) -> None:
    server = _serve(demo_model_dir, "--num-kv-blocks", "2")  # 32 tokens < max_model_len 512: refused
    try:
        code = server.proc.wait(120)
    finally:
        server.stop()
    assert code == 1 and "KV cache" in server.log(), server.log()


def _not_silu(demo_model_dir: Path, tmp_path: Path) -> Path:
    """The demo model with an activation we do not serve (the core's read of its config refuses it)."""
    model_dir = tmp_path / "gelu"
    shutil.copytree(demo_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    return model_dir


@pytest.mark.parametrize("refused", ["max-model-len", "model"])
def test_a_start_refused_by_the_checks_kills_the_core_it_started_early(
    demo_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
    logging_restored: None, refused: str,
) -> None:
    """Refused by the front end's check (--max-model-len against the facts the core sent), or by
    the core's own read of the model (sent as the problem in Prewarmed)."""
    started: list[engine_process.CoreProcess] = []
    start = engine_process.CoreProcess.start

    def recorded(core: engine_process.CoreProcess) -> None:
        start(core)
        started.append(core)

    monkeypatch.setattr(engine_process.CoreProcess, "start", recorded)
    if refused == "model":
        argv, said = [str(_not_silu(demo_model_dir, tmp_path))], "unsupported hidden_act 'gelu'"
    else:
        argv, said = [str(demo_model_dir), "--max-model-len", "99999999"], \
            "--max-model-len 99999999 is longer than the model supports"
    assert main(["serve", *argv, "--port", "0"]) == 1
    (core,) = started  # it ran beside the checks...
    left_running = core.process.exitcode is None
    core.kill()  # (a core left waiting would hold this process's exit: multiprocessing joins it)
    assert not left_running  # ...and is gone, having loaded and logged nothing
    err = capfd.readouterr().err
    assert said in err and err.strip().splitlines()[-1].startswith("inflight serve: error: "), err
    assert "engine core (pid" not in err and "loading model" not in err, err


def test_a_core_that_dies_before_it_sends_the_facts_refuses_the_start(demo_model_dir: Path) -> None:
    core = engine_process.CoreProcess(CoreLaunch(str(demo_model_dir), EngineConfig(device="cpu"), stats_log=False))
    core.start()
    core.process.kill()
    with pytest.raises(ValueError, match=r"the engine core exited while starting \(exit code -9\)"):
        core.served_facts()


def test_a_core_started_without_the_cli_checks_reports_the_problem_it_read(demo_model_dir: Path, tmp_path: Path) -> None:
    """``create_app`` with a bare ``CoreLaunch``: nobody waited for Prewarmed, so the core answers
    Go with the problem it read, as LoadFailed, and loads nothing."""
    server = LiveServer(_not_silu(demo_model_dir, tmp_path), EngineConfig(device="cpu"),
                        ServerSettings(model_name=MODEL_NAME), engine_process=True)
    try:
        with pytest.raises(RuntimeError, match="unsupported hidden_act 'gelu'"):
            server.start()
    finally:
        server.stop()


def test_a_core_whose_front_end_goes_before_go_exits_cleanly(
    demo_model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    core = engine_process.CoreProcess(CoreLaunch(str(demo_model_dir), EngineConfig(device="cpu"), stats_log=False))
    core.start()
    core.conn.close()  # as a front end that exits on a refused start without killing it
    core.process.join(120)
    assert core.process.exitcode == 0
    assert "loading" not in capfd.readouterr().err


def test_greedy_text_is_the_same_in_one_process_and_two(demo_model_dir: Path) -> None:
    """Plain (first, on a fresh server: text and logprob tokens) and then streamed (text) greedy
    completions, both from the same two servers."""
    body = {"model": MODEL_NAME, "prompt": "def fib(n):", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "n": 2, "logprobs": 2}  # fmt: skip
    texts, torch_loaded = [], []
    for mode in ((), ("--single-process",)):
        server = _serve(demo_model_dir, *mode)
        try:
            server.wait_ready()
            gauges = metrics(server.url)  # published by the core before its first request
            assert gauges["inflight:num_kv_blocks"] == 64 and gauges["inflight:kv_cache_usage_perc"] == 0
            reply = http("POST", server.url + "/v1/completions", body).json()
            texts.append([(c["text"], c["logprobs"]["tokens"]) for c in reply["choices"]])
            reply = http("POST", server.url + "/v1/completions", {**body, "stream": True})
            events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
            # chunks may merge tokens when the reader falls behind: compare the text, not the count
            texts.append(["".join(c["text"] for e in events for c in e["choices"] if c["index"] == i)
                          for i in range(body["n"])])
            chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "response_format": {"type": "json_object"}}  # fmt: skip
            assert http("POST", server.url + "/v1/chat/completions", chat).status == 200
            # the front end tokenizes, renders, compiles grammars and detokenizes without torch
            torch_loaded.append("libtorch" in Path(f"/proc/{server.proc.pid}/maps").read_text())
            server.terminate()
            assert server.proc.wait(30) == 0, server.log()
        finally:
            server.stop()
    half = len(texts) // 2
    assert texts[:half] == texts[half:]
    assert torch_loaded == [False, True]  # two processes; one


def test_stop_strings_end_requests_alike_in_one_process_and_two(demo_model_dir: Path) -> None:
    """The engine core sends token ids only; the front end detokenizes and ends a request at its
    stop string (aborting it in the core). Same text, finish reason and usage as one process,
    with async scheduling (the abort reaches the core while a step is in flight) and through
    the offline ``LLM``, which takes the same text path (``OutputText``, then an abort)."""
    body = {"model": MODEL_NAME, "prompt": "def fib(n):", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    results = []
    for mode in ((), ("--single-process",), ("--async-scheduling",)):
        server = _serve(demo_model_dir, *mode)
        try:
            server.wait_ready()
            free = http("POST", server.url + "/v1/completions", body).json()["choices"][0]["text"]
            stop = free[12:15]  # a string the greedy text reaches mid-way
            assert len(stop) == 3 and free.index(stop) >= 1
            stopped = http("POST", server.url + "/v1/completions", {**body, "stop": [stop], "n": 2}).json()
            streamed = http("POST", server.url + "/v1/completions", {**body, "stop": [stop], "stream": True}).text
            results.append((free, [(c["text"], c["finish_reason"]) for c in stopped["choices"]],
                            stopped["usage"]["completion_tokens"], streamed.count('"finish_reason": "stop"')))
            assert all(c["text"] == free[: free.index(stop)] for c in stopped["choices"])
            assert wait_until(lambda s=server: metrics(s.url)["inflight:kv_cache_usage_perc"] == 0, 10)
        finally:
            server.stop()
    assert results[0] == results[1] == results[2]
    with LLM(demo_model_dir, max_num_sequences=2, num_kv_blocks=64, max_model_len=512) as llm:
        greedy = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
        free = llm.generate("def fib(n):", SamplingParams(**greedy))[0].text
        stop = free[12:15]
        stopped = llm.generate(["def fib(n):"] * 2, SamplingParams(**greedy, stop=(stop,)))
        offline = (free, [(o.text, o.finish_reason) for o in stopped], sum(len(o.token_ids) for o in stopped))
        assert llm.engine.stats().num_used_kv_blocks == 0 and not llm.engine.has_unfinished_requests()
    assert offline == results[0][:3]
