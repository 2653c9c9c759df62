"""The scheduler's adapter-slot limit with a fake model (no torch model; issue 49): no step and no
running set holds more than ``max_loras`` adapters, a request whose adapter has no slot waits
without preempting anyone, base-model requests board past it, a stream of requests for a running
adapter cannot starve it, preemption keeps each request's adapter, and the prefix cache never
shares a block between adapters or with the base model. The config's LoRA checks."""

from __future__ import annotations

import random

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.lora.types import LoRARef
from tests.runtime.fake_engine import FakeEngine

REFS = {name: LoRARef(name, i + 1, f"{name}\0digest{i}") for i, name in enumerate("ABCD")}


def _engine(**knobs) -> FakeEngine:
    return FakeEngine(**{"enable_lora": True, "max_num_tokens": 64, "num_kv_blocks": 64, "block_size": 4, **knobs})


def _add(eng: FakeEngine, req_id: str, lora: str | None, prompt_len: int = 6, max_tokens: int = 4, **kw):
    req = eng.add(req_id, prompt_len, max_tokens, **kw)
    req.lora = REFS[lora] if lora else None
    return req


def _adapters(reqs) -> set[str]:
    return {r.lora.name for r in reqs if r.lora is not None}


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_no_step_holds_more_than_max_loras_adapters(policy):
    rng = random.Random(3)
    eng = _engine(max_loras=2, scheduler_policy=policy, num_kv_blocks=24, max_num_sequences=6)
    added = 0
    for _ in range(3000):
        if added < 60 and rng.random() < 0.6:
            _add(eng, f"r{added}", rng.choice([None, "A", "B", "C", "D"]), rng.randint(1, 12), rng.randint(1, 6),
                 tenant=rng.choice(["t1", "t2"]))
            added += 1
        rec = eng.step()
        assert len(_adapters(eng.requests[c.req_id] for c in rec.output.chunks)) <= 2
        assert len(_adapters(eng.scheduler.running)) <= 2
        eng.pool.check_invariants()
        if added == 60 and not eng.scheduler.has_unfinished():
            break
    else:
        raise AssertionError("workload did not drain")
    assert eng.pool.num_used_blocks == 0


def test_a_request_without_a_slot_waits_and_base_requests_board_past_it():
    eng = _engine(max_loras=1)
    _add(eng, "a1", "A", max_tokens=5)
    eng.step()
    _add(eng, "b1", "B")
    _add(eng, "base", None)
    rec = eng.step()
    assert rec.admitted == ["base"] and eng.scheduler.num_preemptions == 0
    assert [r.req_id for r in eng.scheduler.waiting] == ["b1"]


def test_requests_for_a_running_adapter_cannot_starve_a_waiting_one():
    eng = _engine(max_loras=1, max_num_sequences=8)
    _add(eng, "a0", "A", max_tokens=3)
    eng.step()
    _add(eng, "b0", "B", max_tokens=3)
    boarded_b = None
    for step in range(40):
        _add(eng, f"a{step + 1}", "A", max_tokens=3)  # A keeps coming, one a step
        rec = eng.step()
        if "b0" in rec.admitted:
            boarded_b = step
            break
    assert boarded_b is not None and boarded_b <= 4  # once the A requests ahead of it drained


def test_preemption_keeps_the_adapter():
    eng = _engine(max_loras=2, num_kv_blocks=6, enable_prefix_caching=False)
    reqs = [_add(eng, f"r{i}", "AB"[i % 2], prompt_len=8, max_tokens=8) for i in range(3)]
    eng.run()
    assert eng.scheduler.num_preemptions > 0
    assert [r.lora.name for r in reqs] == ["A", "B", "A"]


def test_the_prefix_cache_is_keyed_by_adapter():
    eng = _engine(max_loras=2)
    for i, lora in enumerate([None, "A", "B", "A", None, "B"]):
        req = _add(eng, f"r{i}", lora, prompt_len=9, max_tokens=1)
        eng.run()
        assert req.num_cached_tokens == (8 if i >= 3 else 0), (i, lora)


@pytest.mark.parametrize("knobs,message", [
    ({"max_lora_rank": 0}, "max_lora_rank must be an integer >= 1 and <= 512"),
    ({"max_lora_rank": 1024}, "<= 512"),
    ({"max_loras": 0}, "max_loras must be an integer >= 1"),
    ({"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras .* must be >= max_loras"),
    ({"enable_lora": "yes"}, "enable_lora must be true or false"),
    ({"enable_lora": True, "device": "sim"}, "enable_lora needs the generate runner"),
    ({"enable_lora": True, "async_scheduling": True}, "async_scheduling"),
])
def test_config_refuses_bad_lora_knobs(knobs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**knobs)


def test_config_takes_vllm_ranks():
    for rank in (8, 16, 32, 64, 128, 256, 320, 512, 5):
        assert EngineConfig(enable_lora=True, max_lora_rank=rank).max_lora_rank == rank
