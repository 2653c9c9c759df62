"""``activator_fleet`` by table: every activator replica's demand summed, when a partial sum may
decide (scale up yes, scale to 0 never), and the selector of the activator pods."""

from __future__ import annotations

import pytest

from inflight.operator.activator_fleet import total
from inflight.operator.context import OperatorConfig
from inflight.operator.scale_to_zero import Demand, parse_selector

IDLE = Demand(0, 0, 600.0)
DOWN = "the activator at http://10.0.0.2:8000 cannot be reached (ClientConnectorError: refused)"

SUMS = [
    # (answers, unknown pods, current replicas, usable demand or None)
    ([(IDLE, ""), (Demand(0, 0, 30.0), "")], [], 1, Demand(0, 0, 30.0)),  # idle: the least idle replica's
    ([(Demand(2, 0, 0.0), ""), (Demand(1, 3, 0.0), "")], [], 0, Demand(3, 3, 0.0)),  # held and in flight summed
    ([(IDLE, ""), (Demand(0, 1, 0.0), "")], [], 1, Demand(0, 1, 0.0)),  # one busy replica: not idle
    ([(IDLE, ""), (None, DOWN)], [], 1, None),  # one idle, one unreachable: unknown, never to 0
    ([(IDLE, ""), (None, DOWN)], [], 0, None),  # at 0 with nothing known held: unknown
    ([(Demand(1, 0, 0.0), ""), (None, DOWN)], [], 0, Demand(1, 0, 0.0)),  # held somewhere: enough to go 0 -> 1
    ([(IDLE, "")], ["the activator pods cannot be listed (403)"], 1, None),
    ([], ["no activator pod is running in inflight-system (app=activator)"], 1, None),
]


@pytest.mark.parametrize(("answers", "unknown", "current", "want"), SUMS)
def test_total_and_what_may_decide(answers: list[tuple[Demand | None, str]], unknown: list[str], current: int,
                                   want: Demand | None) -> None:
    fleet = total(answers, unknown)
    demand, why = fleet.usable(current)
    assert demand == want
    if want is None:
        assert why and all(w in why for w in [*unknown, *(w for d, w in answers if d is None)])
    assert fleet.complete == (not unknown and all(d is not None for d, _ in answers) and bool(answers))


@pytest.mark.parametrize(("text", "want"), [
    ("app.kubernetes.io/name=inflight-activator", {"app.kubernetes.io/name": "inflight-activator"}),
    ("a=1, b=2", {"a": "1", "b": "2"}),
])
def test_selector(text: str, want: dict[str, str]) -> None:
    assert parse_selector(text) == want


@pytest.mark.parametrize("bad", ["app", "app!=x", "=x", "a=", ",", "a==b"])
def test_a_bad_selector_is_refused_at_config_time(bad: str) -> None:
    with pytest.raises(ValueError, match="selector"):
        OperatorConfig(activator_pods=bad)
