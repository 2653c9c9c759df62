"""The engine's test-only fault hooks (``INFLIGHT_TEST_ENGINE_FAULT``): parsing and what each does."""

from __future__ import annotations

import threading

import pytest

from inflight.runtime.engine_faults import Fault, InjectedDeath, parse_fault


def test_empty_spec_is_no_fault():
    assert parse_fault("") is None


@pytest.mark.parametrize("spec", ["die", "die-after-steps:", "die-after-steps:x", "stall-after-steps:-1",
                                  "slow-steps:", "slow-steps:1.5", "slow-after-steps:3", "fast-steps:3"])
def test_malformed_spec_is_refused(spec: str):
    with pytest.raises(ValueError, match="slow-steps:MS"):
        parse_fault(spec)


def test_die_after_steps_dies_before_step_n_plus_one():
    fault = parse_fault("die-after-steps:2")
    assert isinstance(fault, Fault)
    fault.before_step()
    fault.before_step()
    with pytest.raises(InjectedDeath):
        fault.before_step()


def test_stall_after_steps_never_returns_from_step_n_plus_one():
    fault = parse_fault("stall-after-steps:1")
    assert isinstance(fault, Fault)
    fault.before_step()
    stalled = threading.Thread(target=fault.before_step, daemon=True)
    stalled.start()
    stalled.join(0.2)  # a stall never returns, so any wait shows it; this one only bounds the test
    assert stalled.is_alive()


def test_slow_steps_sleeps_before_every_step(monkeypatch: pytest.MonkeyPatch):
    sleeps: list[float] = []
    monkeypatch.setattr("inflight.runtime.engine_faults.time.sleep", sleeps.append)
    fault = parse_fault("slow-steps:250")
    assert isinstance(fault, Fault)
    for _ in range(5):
        fault.before_step()  # never dies, never stalls
    assert sleeps == [0.25] * 5
