"""``scale_to_zero.adjust`` by table: the activator's demand on top of the autoscaler's decision,
and ``parse_demand`` on what the activator may answer."""

from __future__ import annotations

from typing import Any

import pytest

from inflight.operator.autoscaler import Decision, Recommendation
from inflight.operator.scale_to_zero import Demand, adjust, parse_demand

WINDOW = 300.0


def _decision(desired: int, queue: float | None = 0.0, reason: str = "Steady") -> Decision:
    return Decision(desired=desired, reason=reason, message="m", recommendation=Recommendation(0.0, desired),
                    kv_cache_usage=0.0 if queue is not None else None, queue_depth=queue)


CASES = [
    # (current, autoscaler's desired, queue, demand, desired, reason)
    (0, 0, None, Demand(1, 0, 0.0), 1, "ScaleFromZero"),
    (0, 0, None, Demand(0, 2, 0.0), 1, "ScaleFromZero"),
    (0, 0, None, Demand(0, 0, 9999.0), 0, "ScaledToZero"),
    (0, 0, None, None, 0, "ActivatorUnavailable"),
    (1, 1, 0.0, Demand(0, 0, WINDOW), 0, "ScaleToZero"),
    (2, 1, 0.0, Demand(0, 0, WINDOW), 0, "ScaleToZero"),
    (1, 1, 0.0, Demand(0, 0, WINDOW - 1), 1, "Steady"),  # inside the idle window
    (1, 1, 0.0, Demand(1, 0, WINDOW), 1, "Steady"),  # something held
    (1, 1, 0.0, Demand(0, 1, WINDOW), 1, "Steady"),  # something in flight
    (1, 1, 2.0, Demand(0, 0, WINDOW), 1, "Steady"),  # the pod's own queue (traffic around the activator)
    (1, 1, None, Demand(0, 0, WINDOW), 1, "Steady"),  # no metrics: never to zero blind
    (3, 2, 0.0, Demand(0, 0, WINDOW), 2, "Steady"),  # down one step at a time, to zero only from 1
    (1, 1, 0.0, None, 1, "Steady"),  # no activator: never to zero
    (1, 0, 0.0, None, 1, "ActivatorUnavailable"),
]


@pytest.mark.parametrize(("current", "desired", "queue", "demand", "want", "reason"), CASES)
def test_adjust(current: int, desired: int, queue: float | None, demand: Demand | None, want: int,
                reason: str) -> None:
    out = adjust(_decision(desired, queue), current, demand, "no activator", WINDOW)
    assert (out.desired, out.reason) == (want, reason)
    if demand is None:
        assert "no activator" in out.message


@pytest.mark.parametrize(("raw", "want"), [
    ({"held": 1, "inFlight": 0, "idleSeconds": 0}, Demand(1, 0, 0.0)),
    ({"held": 0, "inFlight": 3, "idleSeconds": 1.5}, Demand(0, 3, 1.5)),
    ({"held": -1, "inFlight": 0, "idleSeconds": 0}, None),
    ({"held": True, "inFlight": 0, "idleSeconds": 0}, None),
    ({"held": 0, "inFlight": 0}, None),
    ({"held": 0, "inFlight": 0, "idleSeconds": "1"}, None),
    ([], None),
])
def test_parse_demand(raw: Any, want: Demand | None) -> None:
    assert parse_demand(raw) == want
