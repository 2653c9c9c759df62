"""The long-prefill cap (``long_prefill_token_threshold``, vLLM's knob) and how a tenant boards
under the fair policy, with the fake model: a tenant's prompt tokens per step are capped, so
one arriving behind its flood of long prompts waits for a short step, then boards at the very
next step in a step of its own prompts and the others' decodes. FCFS is unchanged unless the
knob is set. Steps and tokens are counted, never timed."""

from __future__ import annotations

import pytest

from inflight.runtime.config import EngineConfig

from .fake_engine import FakeEngine, StepRecord

BUDGET = 256  # the fair policy's default cap: BUDGET // 8 = 32 prompt tokens per tenant and step


def _engine(policy: str, **knobs) -> FakeEngine:
    return FakeEngine(**{"max_num_sequences": 16, "max_num_tokens": BUDGET, "num_kv_blocks": 512,
                         "block_size": 16, "scheduler_policy": policy, **knobs})  # fmt: skip


def _prompt_tokens(rec: StepRecord, eng: FakeEngine) -> dict[str, int]:
    """Prompt tokens per tenant in the step (a chunk of more than one token is a prompt's)."""
    out: dict[str, int] = {}
    for chunk in rec.output.chunks:
        if chunk.num_tokens > 1:
            tenant = eng.requests[chunk.req_id].tenant
            out[tenant] = out.get(tenant, 0) + chunk.num_tokens
    return out


def _flood(eng: FakeEngine, n: int = 8, prompt_len: int = 100) -> None:
    for i in range(n):
        eng.add(f"a{i}", prompt_len, 20, token=i, tenant="a")


def test_fair_caps_one_tenants_prompt_tokens_per_step() -> None:
    eng = _engine("fair")
    _flood(eng)
    records = eng.run()
    assert all(_prompt_tokens(r, eng).get("a", 0) <= BUDGET // 8 for r in records)
    assert _prompt_tokens(records[0], eng) == {"a": 32}
    assert eng.pool.num_used_blocks == 0
    fcfs = _engine("fcfs")  # unchanged: the first step fills the budget with a's prompts
    _flood(fcfs)
    assert _prompt_tokens(fcfs.step(), fcfs) == {"a": BUDGET}


def test_fair_threshold_zero_turns_the_cap_off() -> None:
    eng = _engine("fair", long_prefill_token_threshold=0)
    _flood(eng)
    assert _prompt_tokens(eng.step(), eng) == {"a": BUDGET}


def test_threshold_caps_each_chunk_under_fcfs_as_in_vllm() -> None:
    eng = _engine("fcfs", long_prefill_token_threshold=48)
    _flood(eng, n=3)
    rec = eng.step()
    assert rec.tokens == {"a0": 48, "a1": 48, "a2": 48}  # per request, not per tenant
    assert eng.run()[-1].finished


@pytest.mark.parametrize("threshold", [None, 64])
def test_a_newcomer_boards_at_the_next_step_in_a_short_step(threshold: int | None) -> None:
    eng = _engine("fair", long_prefill_token_threshold=threshold)
    _flood(eng, n=12)
    for _ in range(10):  # a's prompts chunk in while the first ones decode
        eng.step()
    decoding = [r.req_id for r in eng.scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens]
    assert decoding and eng.scheduler.waiting, "a is both decoding and still prefilling"
    for i in range(3):
        eng.add(f"b{i}", 10, 4, token=50 + i, tenant="b")
    boarding = eng.step()
    assert sorted(boarding.admitted) == ["b0", "b1", "b2"]
    assert _prompt_tokens(boarding, eng) == {"b": 30}  # a's prompt chunks sit this step out
    assert all(boarding.tokens.get(r) == 1 for r in decoding)  # a's decodes do not
    assert _prompt_tokens(eng.step(), eng).get("a", 0) == (threshold or BUDGET // 8)  # then a resumes
    eng.run()
    assert eng.pool.num_used_blocks == 0


def test_threshold_validation_and_resolution() -> None:
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0"):
        EngineConfig(long_prefill_token_threshold=-1)
    assert EngineConfig().prefill_token_cap() is None
    assert EngineConfig(scheduler_policy="fair", max_num_tokens=4096).prefill_token_cap() == 512
    assert EngineConfig(scheduler_policy="fair", long_prefill_token_threshold=0).prefill_token_cap() is None
    assert EngineConfig(long_prefill_token_threshold=100).prefill_token_cap() == 100
