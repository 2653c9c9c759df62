"""The fair scheduler policy: tenants (in the server the caller's key, divided by ``user``:
tests/hostile/test_sybil_tenants.py) share slots and the waiting queue by tokens served. A
tenant arriving behind another's flood gets its first tokens within a few steps (a slot is
taken from the flood), instead of after the flood; its requests are still token-identical to
FCFS; the flooding tenant, not the newcomer, gets the 429, and the global queue bound holds;
service state is dropped when a tenant goes idle. Steps are counted, never timed."""

from __future__ import annotations

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.fairness import FairShare
from inflight.runtime.core.request import Request
from inflight.runtime.outputs import QueueFullError
from inflight.runtime.sampling_params import SamplingParams

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(llama_dir, policy: str, **knobs) -> LLMEngine:
    config = dict(device="cpu", num_kv_blocks=256, max_num_sequences=4, max_num_tokens=256,
                  scheduler_policy=policy, max_queue_len=64)  # fmt: skip
    return LLMEngine.from_model_dir(llama_dir, EngineConfig(**{**config, **knobs}))


def _flood_then_newcomer(engine: LLMEngine) -> tuple[int, dict[str, list[int]]]:
    """Tenant a: 10 long requests; after 3 steps tenant b: 2 short ones. Returns the steps b
    waited for its first token, and every request's tokens."""
    for i in range(10):
        engine.add_request(f"a{i}", [5 + i, 6, 7, 8], LONG, tenant="a")
    tokens: dict[str, list[int]] = {}
    steps, b_added_at, b_first = 0, None, None
    while engine.has_unfinished_requests() and steps < 2000:
        if steps == 3:
            for i in range(2):
                engine.add_request(f"b{i}", [9, 10 + i, 11], SHORT, tenant="b")
            b_added_at = steps
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.req_id.startswith("b") and b_first is None and out.new_token_ids:
                b_first = steps
        steps += 1
    assert engine.stats().num_used_kv_blocks == 0
    return b_first - b_added_at, tokens


def test_a_newcomer_behind_a_flood_gets_a_slot_at_once(llama_dir) -> None:
    fcfs_wait, fcfs_tokens = _flood_then_newcomer(_engine(llama_dir, "fcfs"))
    fair_engine = _engine(llama_dir, "fair")
    fair_wait, fair_tokens = _flood_then_newcomer(fair_engine)
    assert fair_wait <= 2 < fcfs_wait, (fair_wait, fcfs_wait)
    assert fair_tokens == fcfs_tokens  # a preempted request recomputes to the same tokens
    assert fair_engine.stats().num_preemptions > 0
    assert fair_engine.scheduler.fair.served == {} and not fair_engine.scheduler.fair.active


def test_the_flooding_tenant_gets_the_429_not_the_newcomer(llama_dir) -> None:
    engine = _engine(llama_dir, "fair", max_num_sequences=2, max_queue_len=4)
    for i in range(5):  # 2 can run, 3 wait: the queue's last place is kept for another tenant
        engine.add_request(f"a{i}", [5, 6], SHORT, tenant="a")
    with pytest.raises(QueueFullError, match="kept for other tenants"):
        engine.add_request("a-more", [5, 6], SHORT, tenant="a")
    engine.add_request("b0", [7, 8], SHORT, tenant="b")  # b has nothing waiting: it takes that place
    with pytest.raises(QueueFullError, match="the server's waiting queue is full"):
        engine.add_request("b1", [7, 9], SHORT, tenant="b")  # the global bound holds under fair too
    assert engine.scheduler.num_waiting == 2 + 4
    fcfs = _engine(llama_dir, "fcfs", max_num_sequences=2, max_queue_len=4)
    for i in range(6):
        fcfs.add_request(f"a{i}", [5, 6], SHORT, tenant="a")
    with pytest.raises(QueueFullError):
        fcfs.add_request("b0", [7, 8], SHORT, tenant="b")  # under fcfs everyone is refused


def _req(tenant: str, seq: int, priority: int = 0) -> Request:
    return Request(f"{tenant}{seq}", [1, 2], SHORT, priority, None, seq, tenant)


def test_least_served_tenant_first_then_priority() -> None:
    fair = FairShare()
    for t in ("a", "b"):
        fair.add(t)
    fair.charge("a", 500)  # a's long prompts were served
    reqs = [_req("a", 0), _req("b", 1, priority=5), _req("b", 2, priority=1)]
    assert [r.req_id for r in sorted(reqs, key=fair.order_key)] == ["b2", "b1", "a0"]
    fair.add("c")  # a newcomer starts at the least service of the active tenants: no credit
    assert fair.served["c"] == fair.served["b"] == 0
    fair.charge("b", 800)
    fair.remove("c")
    fair.add("c")
    assert fair.served["c"] == 0  # the step in flight charged a and b: c starts where it began
    fair.begin_step()
    fair.remove("c")
    fair.add("c")
    assert fair.served["c"] == 500  # nothing charged since: the least service of the active
    fair.charge("a", 300)  # a's chunk of the step now running
    fair.remove("c")
    fair.add("c")
    assert fair.served["c"] == 500 and fair.served["a"] == 800  # c goes ahead of a's next chunk


def test_slot_victim_is_the_newest_of_the_heaviest_tenant() -> None:
    running = [_req("a", i) for i in range(3)] + [_req("b", 3)]
    for i, r in enumerate(running):
        r.admitted_seq = i
    newcomer = _req("c", 9)
    victim = FairShare.slot_victim(newcomer, running, 4, [newcomer])
    assert victim is not None and victim.req_id == "a2"
    b_first = FairShare.slot_victim(_req("b", 10), running, 4, [])  # b holds 1 of its 2 slots
    assert b_first is not None and b_first.req_id == "a2"
    even = [_req("a", 0), _req("a", 1), _req("b", 2), _req("b", 3)]
    assert FairShare.slot_victim(_req("b", 10), even, 4, []) is None  # b already holds its share
