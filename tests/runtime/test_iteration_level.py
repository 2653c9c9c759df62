"""Iteration-level batching, shown step by step on the real engine.

A short request finishes and a waiting one boards at the very next step while a long one
keeps running; under ``static`` the same inputs admit nothing until the batch has finished.
"""

from __future__ import annotations

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams


def _trace(model_dir, policy: str) -> list[dict[str, bool]]:
    engine = LLMEngine.from_model_dir(
        model_dir, EngineConfig(max_num_sequences=2, num_kv_blocks=64, scheduler_policy=policy)
    )
    greedy = dict(temperature=0.0, ignore_eos=True)
    engine.add_request("short", engine.encode_prompt("a = 1"), SamplingParams(max_tokens=2, **greedy))
    engine.add_request("long", engine.encode_prompt("def f(x):"), SamplingParams(max_tokens=10, **greedy))
    engine.add_request("waiting", engine.encode_prompt("import os"), SamplingParams(max_tokens=3, **greedy))
    steps = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps.append({o.req_id: o.finished for o in outs})
        assert engine.stats().num_running <= 2
    assert engine.stats().num_used_kv_blocks == 0
    return steps


def test_waiting_request_boards_the_step_after_a_finish(llama_dir):
    steps = _trace(llama_dir, "fcfs")
    short_done = next(i for i, s in enumerate(steps) if s.get("short"))
    waiting_first = next(i for i, s in enumerate(steps) if "waiting" in s)
    assert waiting_first == short_done + 1, steps
    assert "long" in steps[waiting_first] and not steps[waiting_first]["long"], "long keeps running"
    long_done = next(i for i, s in enumerate(steps) if s.get("long"))
    assert waiting_first < long_done


def test_static_policy_waits_for_the_whole_batch(llama_dir):
    steps = _trace(llama_dir, "static")
    long_done = next(i for i, s in enumerate(steps) if s.get("long"))
    waiting_first = next(i for i, s in enumerate(steps) if "waiting" in s)
    assert waiting_first == long_done + 1, steps
