"""Scheduler tests with a fake model: budgets, chunking, priorities, preemption, static batching."""

from __future__ import annotations

import random

import pytest

from .fake_engine import FakeEngine


@pytest.mark.parametrize("policy", ["fcfs", "priority", "static"])
@pytest.mark.parametrize("chunked", [True, False])
def test_budget_and_max_num_sequences_never_exceeded(policy, chunked):
    rng = random.Random(7)
    eng = FakeEngine(max_num_sequences=5, max_num_tokens=48, num_kv_blocks=24, block_size=8,
                     scheduler_policy=policy, enable_chunked_context=chunked, max_model_len=64 if not chunked else None)
    added = 0
    for _step in range(2000):
        if added < 40 and rng.random() < 0.5:
            eng.add(f"r{added}", rng.randint(1, 40), rng.randint(1, 20), priority=rng.randint(0, 3),
                    token=rng.randint(0, 3))
            added += 1
        rec = eng.step()
        assert rec.output.num_batched_tokens == sum(rec.tokens.values()) <= 48
        assert len(rec.running) <= 5
        assert len(rec.tokens) == len(rec.output.chunks), "a request scheduled twice in one step"
        eng.pool.check_invariants()
        if added == 40 and not eng.scheduler.has_unfinished():
            break
    else:
        raise AssertionError("workload did not drain")
    assert eng.pool.num_used_blocks == 0


def test_long_prompt_is_chunked_while_decodes_continue():
    eng = FakeEngine(max_num_tokens=32, num_kv_blocks=64, block_size=16)
    eng.add("short", 4, 30)
    eng.step()  # prefill of the short one
    eng.add("long", 200, 5)
    chunk_sizes = []
    for _ in range(8):
        rec = eng.step()
        assert rec.tokens.get("short") == 1, "the running decode was starved"
        chunk_sizes.append(rec.tokens.get("long", 0))
    assert all(0 < c <= 31 for c in chunk_sizes[:6]), chunk_sizes
    assert sum(chunk_sizes) >= 6 * 31 - 1


def test_unchunked_prompt_waits_for_a_whole_budget():
    eng = FakeEngine(max_num_tokens=64, num_kv_blocks=64, enable_chunked_context=False, max_model_len=64)
    eng.add("a", 40, 3, token=1)
    eng.add("b", 40, 3, token=2)
    records = eng.run()
    assert records[0].tokens == {"a": 40}, "b does not fit the rest of the budget and is not split"
    assert records[0].admitted == ["a"]
    # Step 2: a's decode leaves 63 tokens, so b boards with its whole prompt, not a piece of it.
    assert records[1].tokens == {"a": 1, "b": 40}
    assert records[1].admitted == ["b"]
    b_chunks = [rec.tokens["b"] for rec in records if "b" in rec.tokens]
    assert b_chunks == [40, 1, 1], "b's prompt is computed in one chunk, then decodes one token a step"


def test_finished_request_makes_room_at_the_very_next_step():
    eng = FakeEngine(max_num_sequences=2, max_num_tokens=64, num_kv_blocks=64)
    eng.add("short", 4, 2)
    eng.add("long", 4, 10)
    eng.add("waiting", 4, 3)
    first = eng.step()
    assert first.admitted == ["short", "long"]
    second = eng.step()
    assert second.finished == ["short"]
    third = eng.step()
    assert third.admitted == ["waiting"], "the waiting request boards the step after a finish"
    assert "long" in third.tokens


def test_static_admits_nothing_until_the_whole_batch_finished():
    eng = FakeEngine(max_num_sequences=2, max_num_tokens=64, num_kv_blocks=64, scheduler_policy="static")
    eng.add("short", 4, 2)
    eng.add("long", 4, 10)
    eng.add("waiting", 4, 3)
    records = eng.run()
    finish_step = next(i for i, r in enumerate(records) if "long" in r.finished)
    admit_step = next(i for i, r in enumerate(records) if "waiting" in r.admitted)
    assert admit_step == finish_step + 1
    short_done = next(i for i, r in enumerate(records) if "short" in r.finished)
    assert short_done < finish_step


def test_priority_admission_order():
    eng = FakeEngine(max_num_sequences=1, max_num_tokens=64, num_kv_blocks=64, scheduler_policy="priority")
    eng.add("low", 4, 2, priority=5)
    eng.add("high", 4, 2, priority=0)
    eng.add("mid", 4, 2, priority=1)
    order = [r.admitted[0] for r in eng.run() if r.admitted]
    assert order == ["high", "mid", "low"]


def test_fcfs_preempts_the_most_recently_admitted():
    eng = FakeEngine(max_num_sequences=4, max_num_tokens=256, num_kv_blocks=6, block_size=4,
                     enable_prefix_caching=False)
    eng.add("first", 7, 12, token=1)
    eng.add("second", 7, 12, token=2)
    eng.add("third", 7, 12, token=3)
    records = eng.run()
    victims = [r.req_id for rec in records for r in rec.output.preempted]
    assert victims and victims[0] == "third"
    assert eng.scheduler.num_preemptions == len(victims)
    assert eng.pool.num_used_blocks == 0


def test_priority_preempts_the_lowest_priority():
    eng = FakeEngine(max_num_sequences=4, max_num_tokens=256, num_kv_blocks=6, block_size=4,
                     scheduler_policy="priority", enable_prefix_caching=False)
    eng.add("vip", 7, 12, priority=0, token=1)
    eng.add("batch", 7, 12, priority=9, token=2)
    eng.add("normal", 7, 12, priority=3, token=3)
    records = eng.run()
    victims = [r.req_id for rec in records for r in rec.output.preempted]
    assert victims and victims[0] == "batch"
    assert "vip" not in victims


def test_a_request_preempted_while_its_step_in_flight_speculates_boards_once_that_step_is_read():
    """Async scheduling with pipelined speculation (core/spec_pipeline.py): a request whose step in
    flight speculates carries a placeholder per position that step computes, standing for tokens of
    a number not known yet, which no prompt chunk can feed. Preempted then, it waits, and the
    requests behind it board; once the step is read (its placeholders become tokens) it boards."""
    eng = FakeEngine(max_num_sequences=4, max_num_tokens=256, num_kv_blocks=16, block_size=4,
                     enable_prefix_caching=False)  # fmt: skip
    spec = eng.add("spec", 6, 12, token=1)
    eng.step()
    spec.token_ids.extend([-1, -1, -1])  # its step in flight computes three positions (two drafts)
    assert spec.awaits_drafts
    eng.scheduler._preempt(spec)
    eng.add("later", 5, 12, token=2)
    record = eng.step()
    assert record.admitted == ["later"] and "spec" not in record.tokens
    del spec.token_ids[-3:]
    spec.token_ids.extend([8, 9])  # the step kept one draft
    record = eng.step()
    assert record.admitted == ["spec"] and record.tokens["spec"] == 9  # prompt, first token and the two, recomputed
