"""A torch-free engine double: the real scheduler and block pool with a fake model.

Each step "computes" the scheduled tokens and, where a chunk completes a sequence's known
tokens, appends a dummy token; a request finishes after ``max_tokens`` outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.block_pool import KVBlockPool
from inflight.runtime.core.kv_manager import KVCacheManager
from inflight.runtime.core.request import Request
from inflight.runtime.core.sched_output import SchedulerOutput
from inflight.runtime.core.scheduler import Scheduler
from inflight.runtime.sampling_params import SamplingParams


@dataclass
class StepRecord:
    output: SchedulerOutput
    running: list[str]
    finished: list[str] = field(default_factory=list)

    @property
    def admitted(self) -> list[str]:
        return [r.req_id for r in self.output.admitted]

    @property
    def tokens(self) -> dict[str, int]:
        return {c.req_id: c.num_tokens for c in self.output.chunks}


class FakeEngine:
    def __init__(self, **config) -> None:
        self.config = EngineConfig(**config)
        self.pool = KVBlockPool(self.config.num_kv_blocks or 64, self.config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, self.config.block_size)
        self.scheduler = Scheduler(self.config, self.kv)
        self.seq = 0
        self.requests: dict[str, Request] = {}

    def add(self, req_id: str, prompt_len: int, max_tokens: int, priority: int = 0, token: int = 5,
            tenant: str = "") -> Request:
        req = Request(req_id, [token] * prompt_len, SamplingParams(max_tokens=max_tokens), priority, 0.0, self.seq,
                      tenant)
        self.seq += 1
        self.requests[req_id] = req
        self.scheduler.add(req)
        return req

    def step(self) -> StepRecord:
        out = self.scheduler.schedule()
        record = StepRecord(out, [r.req_id for r in self.scheduler.running])
        for chunk in out.chunks:
            req = self.requests[chunk.req_id]
            req.num_computed_tokens += chunk.num_tokens
            self.kv.cache_computed_blocks(req)
            if chunk.sample:
                req.append_token(7)
                if req.num_output_tokens >= req.params.max_tokens:
                    self.scheduler.remove(req)
                    record.finished.append(req.req_id)
        return record

    def run(self, max_steps: int = 1000) -> list[StepRecord]:
        records = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return records
            records.append(self.step())
        raise AssertionError("fake engine did not finish")
