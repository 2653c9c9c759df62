"""Table-driven tests of the pure autoscaling decision."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from inflight.operator.autoscaler import (
    Observations,
    PodMetrics,
    Policy,
    Recommendation,
    decide,
    prune,
)

POLICY = Policy(
    min_replicas=1, max_replicas=10, target_kv_cache_usage=0.8, target_queue_depth=4.0,
    scale_up_window_s=0.0, scale_down_window_s=60.0,
)


def pods(*values: tuple[float | None, float | None]) -> tuple[PodMetrics, ...]:
    return tuple(PodMetrics(f"p{i}", kv, q) for i, (kv, q) in enumerate(values))


@dataclass(frozen=True)
class Case:
    name: str
    obs: Observations
    desired: int
    reason: str
    history: tuple[Recommendation, ...] = ()
    policy: Policy = POLICY
    now: float = 1000.0


CASES = [
    Case("scale up on kv", Observations(2, pods((1.0, 0), (1.0, 0))), 3, "ScaleUpKvCache"),
    Case("scale up on queue", Observations(2, pods((0.3, 12), (0.3, 12))), 6, "ScaleUpQueue"),
    Case("queue wins when larger", Observations(1, pods((0.9, 8))), 2, "ScaleUpQueue"),
    Case("hold inside tolerance", Observations(2, pods((0.85, 0), (0.82, 0))), 2, "WithinTolerance"),
    Case("hold inside tolerance below", Observations(2, pods((0.75, 0), (0.75, 0))), 2, "WithinTolerance"),
    Case("scale down with no history", Observations(4, pods((0.1, 0),) * 4), 1, "ScaleDown"),
    Case(
        "scale down held by window",
        Observations(4, pods((0.1, 0),) * 4), 4, "StabilizingDown",
        history=(Recommendation(970.0, 4),),
    ),
    Case(
        "scale down to the window's highest recommendation",
        Observations(4, pods((0.1, 0),) * 4), 3, "StabilizingDown",
        history=(Recommendation(950.0, 3), Recommendation(900.0, 4)),
    ),
    Case(
        "scale down once the window has passed",
        Observations(4, pods((0.1, 0),) * 4), 1, "ScaleDown",
        history=(Recommendation(930.0, 4),),
    ),
    Case(
        "scale up held by up window",
        Observations(1, pods((1.6, 0),)), 1, "StabilizingUp",
        history=(Recommendation(995.0, 1),),
        policy=Policy(1, 10, 0.8, 4.0, scale_up_window_s=30.0, scale_down_window_s=60.0),
    ),
    Case("clamp at max while scaling up", Observations(8, pods(*[(1.0, 40)] * 8)), 10, "ScaleUpQueue"),
    Case("clamp at max holds at max", Observations(10, pods(*[(1.0, 40)] * 10)), 10, "ClampedMax"),
    Case("clamp at min while scaling down", Observations(4, pods(*[(0.0, 0)] * 4)), 2, "ScaleDown",
         policy=Policy(2, 10, 0.8, 4.0)),
    Case("clamp at min holds at min", Observations(2, pods((0.0, 0), (0.0, 0))), 2, "ClampedMin",
         policy=Policy(2, 10, 0.8, 4.0)),
    Case(
        "raise to min when below",
        Observations(1, pods((0.8, 4),)), 3, "ClampedMin",
        policy=Policy(3, 10, 0.8, 4.0),
    ),
    Case(
        "lower to max when above", Observations(12, pods(*[(0.8, 4)] * 12)), 10, "ClampedMax",
    ),
    Case("pending pods block scale-up", Observations(3, pods((1.0, 20), (1.0, 20)), num_pending=1), 3,
         "PendingPods"),
    Case("pending pods do not block scale-down", Observations(3, pods((0.1, 0), (0.1, 0)), num_pending=1), 1,
         "ScaleDown"),
    Case("no ready pods holds", Observations(2, ()), 2, "NoReadyPods"),
    Case("no metrics holds", Observations(2, pods((None, None), (None, None))), 2, "NoMetrics"),
    # Missing metrics count as zero on the way up: 2 pods, one at 2x target -> mean 1x... -> hold.
    Case("missing metrics as zero on the way up", Observations(2, pods((1.6, 0), (None, None))), 2,
         "WithinTolerance"),
    Case("missing metrics as zero, still up", Observations(2, pods((0.8, 40), (None, None))), 10, "ScaleUpQueue"),
    # ... and as on-target on the way down: 1 idle + 1 unknown -> mean 0.5x -> 1 replica, not 0.
    Case("missing metrics as target on the way down", Observations(4, pods((0.0, 0), (None, None), (0.0, 0),
                                                                         (None, None))), 2, "ScaleDown"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decide(case: Case) -> None:
    decision = decide(case.obs, case.policy, case.history, case.now)
    assert (decision.desired, decision.reason) == (case.desired, case.reason), decision.message
    assert decision.recommendation.time == case.now


def test_decision_reports_observed_means() -> None:
    decision = decide(Observations(2, pods((0.5, 2), (0.7, 4), (None, None))), POLICY, (), 0.0)
    assert decision.kv_cache_usage == pytest.approx(0.6)
    assert decision.queue_depth == pytest.approx(3.0)


def test_scale_down_happens_only_after_the_window_in_a_sequence() -> None:
    """Load drops at t=0: replicas stay until the last high recommendation leaves the window."""
    history: tuple[Recommendation, ...] = (Recommendation(-10.0, 4),)
    idle = Observations(4, pods((0.0, 0),) * 4)
    desired = []
    for t in (0.0, 20.0, 40.0, 49.0, 51.0):
        decision = decide(idle, POLICY, history, t)
        history = prune(history + (decision.recommendation,), POLICY, t)
        desired.append(decision.desired)
    assert desired == [4, 4, 4, 4, 1]


def test_prune_keeps_the_longest_window() -> None:
    history = (Recommendation(0.0, 1), Recommendation(50.0, 2))
    assert prune(history, POLICY, 100.0) == (Recommendation(50.0, 2),)
