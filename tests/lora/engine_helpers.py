"""Driving an engine with LoRA requests in the tests: staggered adds, every step's adapters
checked against ``max_loras``, the KV pool checked at the end."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Job:
    prompt: list[int]
    lora: str | None
    max_tokens: int
    tenant: str = ""


def run_jobs(engine: LLMEngine, jobs: Sequence[Job], per_step: int = 2) -> list[list[int]]:
    """Add ``per_step`` jobs before each step (greedy); the tokens of each job, in order. Every
    step's running set keeps to ``max_loras`` adapters."""
    tokens: list[list[int]] = [[] for _ in jobs]
    done: set[int] = set()
    added = 0
    for _ in range(10_000):
        for _ in range(per_step):
            if added < len(jobs):
                job = jobs[added]
                engine.add_request(str(added), job.prompt, SamplingParams(max_tokens=job.max_tokens, temperature=0.0),
                                   lora_name=job.lora, tenant=job.tenant)
                added += 1
        for out in engine.step():
            tokens[int(out.req_id)].extend(out.new_token_ids)
            if out.finished:
                done.add(int(out.req_id))
        running = {r.lora.load_id for r in engine.scheduler.running if r.lora is not None}
        assert len(running) <= engine.config.max_loras, running
        if len(done) == len(jobs):
            assert_no_leaks(engine)
            return tokens
    raise AssertionError("the engine did not finish within 10000 steps")


def assert_no_leaks(engine: LLMEngine) -> None:
    """Nothing left running, every KV block free (cached ones count as free)."""
    assert not engine.has_unfinished_requests()
    engine.pool.check_invariants()
    assert engine.pool.num_used_blocks == 0, engine.pool.num_used_blocks
