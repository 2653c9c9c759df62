"""Tensor-parallel start-up, step channel and supervision on the CPU (gloo), offline.

The model must split (else ValueError before any process starts); a worker that fails or
dies during start-up fails the start at once with its message; a SIGKILLed worker turns
the next step into ``EngineFatalError`` whether the engine is busy or idle, and closing the
engine leaves no worker process behind; a step that fails (or is interrupted) half-way is
fatal for good, since the ranks are then out of step. Steps too large for one channel message take two.
A death the engine thread does not act on within the grace (it is blocked in a step) goes to the
owner's ``on_stuck`` hook; one it acts on (the group closed) does not.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from inflight.runtime.distributed import comm, launcher
from inflight.runtime.llm import LLM
from inflight.runtime.model.layout import shard_layout, valid_tensor_parallel_sizes
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config
from inflight.runtime.outputs import EngineFatalError
from inflight.runtime.sampling_params import SamplingParams


def test_layout_splits_heads_and_replicates_kv_heads(model_factory) -> None:
    spec = spec_from_hf_config(load_hf_config(model_factory("llama")))  # 4 heads, 2 KV heads
    assert valid_tensor_parallel_sizes(spec) == [1, 2, 4]
    four = [shard_layout(spec, r, 4) for r in range(4)]
    assert [(lay.q_head_start, lay.num_heads) for lay in four] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert [(lay.kv_head_start, lay.num_kv_heads) for lay in four] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    two = [shard_layout(spec, r, 2) for r in range(2)]
    assert [(lay.vocab_start, lay.vocab_end) for lay in two] == [(0, 512), (512, spec.vocab_size)]
    with pytest.raises(ValueError, match="does not evenly divide the model's 4 attention heads.*1, 2, 4"):
        shard_layout(spec, 0, 3)


def test_tp_size_that_does_not_divide_the_heads_fails_before_any_process(model_factory) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 3"):
        LLM(model_factory("llama"), tensor_parallel_size=3, num_kv_blocks=8)


def test_worker_that_fails_to_load_fails_the_start_with_its_message(model_factory, monkeypatch) -> None:
    spawn = launcher._spawn

    def bad_dir(rank, world, port, model_dir, config, *where):
        return spawn(rank, world, port, Path(model_dir) / "missing", config, *where)

    monkeypatch.setattr(launcher, "_spawn", bad_dir)
    # The worker's own message (not a start-up timeout's) proves the start failed on its report.
    with pytest.raises(RuntimeError, match="worker rank 1 failed to start: ValueError: .*missing is not a model"):
        LLM(model_factory("llama"), tensor_parallel_size=2, num_kv_blocks=8)


def test_worker_that_dies_at_start_fails_the_start_at_once(model_factory, monkeypatch) -> None:
    monkeypatch.setattr(launcher, "_spawn", lambda *a: subprocess.Popen([sys.executable, "-c", "raise SystemExit(7)"]))
    # The exit code in the message (not a start-up timeout) proves the death itself failed the start.
    with pytest.raises(RuntimeError, match="rank 1 .* exited with code 7 during start-up"):
        LLM(model_factory("llama"), tensor_parallel_size=2, num_kv_blocks=8)


@pytest.mark.parametrize("when", ["busy", "idle"])
def test_killed_worker_is_a_fatal_engine_error(model_factory, when: str) -> None:
    with LLM(model_factory("llama"), tensor_parallel_size=2, num_kv_blocks=64) as llm:
        engine = llm.engine
        procs = list(engine.runner.workers._procs.values())
        params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        for i in range(8):
            engine.add_request(str(i), [1, 5, 7, 9] * 10, params)
        for _ in range(3):
            engine.step()
        if when == "idle":
            for i in range(8):
                engine.abort_request(str(i))
            assert not engine.has_unfinished_requests()
        os.kill(procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineFatalError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            while time.monotonic() - t0 < 60:  # patience only: the next step (busy) or the idle poll raises
                if engine.has_unfinished_requests():
                    engine.step()
                else:
                    time.sleep(0.01)
    assert all(p.poll() is not None for p in procs)


def test_steps_larger_than_one_message_take_two_broadcasts(model_factory, monkeypatch) -> None:
    monkeypatch.setattr(comm, "_INLINE_LEN", 16)
    monkeypatch.setenv("INFLIGHT_TP_INLINE_INTS", "16")  # the worker reads it at import
    prompts = ["def fib(n):", "import os\nimport sys\n" * 4, "x"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    with LLM(model_factory("mistral"), num_kv_blocks=32) as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
    with LLM(model_factory("mistral"), num_kv_blocks=32, tensor_parallel_size=2) as two:
        got = [o.token_ids for o in two.generate(prompts, params)]
    assert got == want


def test_overhead_bench_runs(model_factory, capsys) -> None:
    from bench.studies import tensor_parallel as bench

    assert bench.main(["--model", str(model_factory("llama")), "--batch", "1", "3", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "batch 1: TP=2 minus TP=1" in out and "batch 3: TP=2 minus TP=1" in out


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failure_inside_a_step_is_fatal_for_good(model_factory, error: BaseException) -> None:
    """Once rank 0 leaves a step half-way the ranks are out of step: never step again."""
    with LLM(model_factory("llama"), tensor_parallel_size=2, num_kv_blocks=32) as llm:
        engine = llm.engine
        procs = list(engine.runner.workers._procs.values())
        engine.add_request("a", [1, 5, 7, 9], SamplingParams(max_tokens=50, temperature=0.0))
        engine.step()
        forward = engine.runner._forward

        def failing(*args):
            engine.runner._forward = forward
            raise error

        engine.runner._forward = failing
        with pytest.raises(EngineFatalError if isinstance(error, Exception) else KeyboardInterrupt):
            engine.step()
        with pytest.raises(EngineFatalError, match="step failed: boom|step was interrupted"):
            engine.step()
        assert engine.has_unfinished_requests()
    assert all(p.poll() is not None for p in procs)


def _group_with_a_dead_worker(grace_s: float) -> launcher.WorkerGroup:
    """A worker group (no collectives joined) whose one worker has already exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    group = launcher.WorkerGroup(dist.HashStore(), {1: proc}, 2)
    group.stuck_grace_s = grace_s
    return group


def test_a_dead_worker_with_the_group_still_open_calls_the_owners_hook() -> None:
    """The engine thread did not close the group within the grace (blocked in a collective with
    the dead rank): the monitor hands the failure to ``on_stuck``."""
    group = _group_with_a_dead_worker(0.05)
    called = threading.Event()
    failures: list[str] = []
    group.on_stuck = lambda failure: (failures.append(failure), called.set())
    group._monitor.start()
    try:
        assert called.wait(60.0)
        assert failures == [f"tensor-parallel worker rank 1 (pid {group._procs[1].pid}) exited with code 0"]
    finally:
        group.close()


def test_an_engine_that_closes_the_group_after_a_death_is_left_alone() -> None:
    """The engine thread failed its step and closed the group (the usual way) within the grace:
    the monitor ends without calling ``on_stuck``."""
    group = _group_with_a_dead_worker(3600.0)  # only a close ends the monitor's wait
    calls: list[str] = []
    group.on_stuck = calls.append
    group._monitor.start()
    deadline = time.monotonic() + 60.0
    while group.failure is None and time.monotonic() < deadline:  # a hang guard, not a speed claim
        time.sleep(0.01)
    assert group.failure is not None
    group.close()
    group._monitor.join(60.0)
    assert not group._monitor.is_alive() and calls == []
