"""Pipeline stages under failure (issue 54): a killed rank mid-stream stops the group as a unit.

Offline: a SIGKILLed worker of any stage turns the next step into ``EngineFatalError`` naming
the rank, with steps in flight (rank 0 waits on the last stage's logits: gloo fails the receive
when the peer's socket closes, and the collective timeout bounds it otherwise), and closing the
engine leaves no worker behind. Through ``inflight serve --pipeline-parallel-size 2``: every
stream in flight gets the ``engine_dead`` error event and the server exits non-zero.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import pytest

from inflight.runtime.engine_faults import FAULT_ENV
from inflight.runtime.llm import LLM
from inflight.runtime.outputs import EngineFatalError
from inflight.runtime.sampling_params import SamplingParams
from tests.server.server_helpers import ServeProcess

from .test_tensor_parallel_server import (
    ENGINE_ARGS,
    MODEL,
    PROMPTS,
    SLOW_STEPS,
    _client,
    _health,
    _in_flight,
    _worker_pids,
    openai,
    wait_until,
)


@pytest.mark.parametrize(("tp", "victim"), [(1, 1), (2, 3), (2, 1)], ids=["pp2-last", "tp2pp2-last", "tp2pp2-first"])
def test_killed_rank_mid_stream_is_a_fatal_engine_error(model_factory, tp: int, victim: int) -> None:
    with LLM(model_factory("llama"), tensor_parallel_size=tp, pipeline_parallel_size=2, num_kv_blocks=64) as llm:
        engine = llm.engine
        procs = engine.runner.workers._procs
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        for i in range(8):
            engine.add_request(str(i), [1, 5, 7, 9] * 10, params)
        for _ in range(4):
            engine.step()
        while not engine.pipeline.busy:  # one batch holds the 8 requests: in flight every other call
            engine.step()
        os.kill(procs[victim].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineFatalError, match=rf"rank {victim} \(pid \d+\) was killed by SIGKILL"):
            while time.monotonic() - t0 < 120:  # patience only: a step raises
                engine.step()
        with pytest.raises(EngineFatalError):  # for good: the ranks are out of step
            engine.step()
    assert all(p.poll() is not None for p in procs.values()), "a worker outlived its engine"


def test_killed_stage_fails_every_stream_and_the_server_exits(model_factory) -> None:
    server = ServeProcess(["--model", str(model_factory("llama")), "--served-model-name", MODEL, "--port", "0",
                           "--pipeline-parallel-size", "2", *ENGINE_ARGS, "--num-kv-blocks", "64"],
                          env={FAULT_ENV: SLOW_STEPS})
    try:
        server.wait_ready()
        (worker,) = _worker_pids(server.proc.pid)
        client = _client(server)

        def stream(i: int) -> str:
            try:
                for _ in client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=120, temperature=0.0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                    pass
                return "finished"
            except openai.APIStatusError as exc:
                return f"status {exc.status_code} {(exc.body or {}).get('code')}"
            except openai.APIError as exc:
                return f"error {exc.body.get('code') if isinstance(exc.body, dict) else type(exc).__name__}"

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream, i) for i in range(8)]
            assert wait_until(lambda: _in_flight(server) == 8, 30), "the 8 streams never reached the engine"
            os.kill(worker, signal.SIGKILL)
            assert wait_until(lambda: _health(server) != 200, 60), "/health still 200 after the stage died"
            code = server.proc.wait(60)
            answers = [f.result(timeout=60) for f in futures]
    finally:
        server.stop()
    assert code != 0
    assert answers == ["error engine_dead"] * 8, answers
    assert "rank 1" in server.log() and "SIGKILL" in server.log()
