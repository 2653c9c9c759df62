"""The TTFT-backlog signal, table-driven: seconds of backlog per pod (queued prompt tokens over
the measured prefill rate) beside KV usage and queue depth, off without a target, no signal
(never infinity) without a measured rate; its field in the CR, its metrics in the scrape, and
the reason it leaves in each recommendation."""

from __future__ import annotations

import dataclasses
import math
import pathlib
from dataclasses import dataclass

import jsonschema
import pytest
import yaml

from inflight.operator import metrics_scrape, status
from inflight.operator.autoscale_round import policy_of
from inflight.operator.autoscaler import Observations, PodMetrics, Policy, Recommendation, decide
from inflight.operator.spec import parse_spec

REPO = pathlib.Path(__file__).resolve().parents[2]
OFF = Policy(min_replicas=1, max_replicas=10, target_kv_cache_usage=0.8, target_queue_depth=4.0,
             scale_up_window_s=0.0, scale_down_window_s=0.0)
ON = Policy(min_replicas=1, max_replicas=10, target_kv_cache_usage=0.8, target_queue_depth=4.0,
            scale_up_window_s=0.0, scale_down_window_s=0.0, target_ttft_seconds=2.0)


def pod(kv: float | None, queue: float | None, backlog: float | None = None, rate: float | None = None,
        name: str = "p") -> PodMetrics:
    return PodMetrics(name, kv, queue, prefill_backlog_tokens=backlog, prefill_tokens_per_second=rate)


def pods(*specs: tuple[float | None, ...]) -> tuple[PodMetrics, ...]:
    return tuple(pod(*s, name=f"p{i}") for i, s in enumerate(specs))  # type: ignore[misc]


@dataclass(frozen=True)
class Case:
    name: str
    obs: Observations
    policy: Policy
    desired: int
    reason: str
    ttft: float | None  # Decision.ttft_backlog_seconds
    history: tuple[Recommendation, ...] = ()


CASES = [
    # 3000 tokens at 500 tokens/s = 6 s against 2 s: ratio 3, while kv 0.3 and queue 1 say "down".
    Case("ttft scales up where kv and queue do not", Observations(1, pods((0.3, 1, 3000, 500))), ON, 3,
         "ScaleUpTtft", 6.0),
    Case("the same burst without a target: kv and queue alone", Observations(1, pods((0.3, 1, 3000, 500))), OFF, 1,
         "Steady", None),
    Case("no prefill rate measured yet: no signal, not infinity", Observations(2, pods((0.3, 1, 9000, 0.0),) * 2), ON,
         1, "ScaleDown", None),
    Case("a runtime without the metrics: no signal", Observations(1, pods((0.3, 1, None, None))), ON, 1, "Steady",
         None),
    Case("a NaN rate is no rate", Observations(1, pods((0.3, 1, 3000, math.nan))), ON, 1, "Steady", None),
    Case("a pod without a rate counts 0 s beside one with", Observations(2, pods((0.3, 1, 4000, 500),
                                                                                  (0.3, 1, 4000, 0.0))), ON, 4,
         "ScaleUpTtft", 4.0),
    Case("kv wins when its ratio is larger", Observations(2, pods((1.0, 0, 100, 100), (1.0, 0, 100, 100))), ON, 3,
         "ScaleUpKvCache", 1.0),
    Case("queue wins when its ratio is larger", Observations(1, pods((0.3, 12, 500, 100))), ON, 3, "ScaleUpQueue",
         5.0),
    Case("ttft inside the tolerance band holds", Observations(1, pods((0.3, 1, 2100, 1000))), ON, 1,
         "WithinTolerance", 2.1),
    Case("ttft low on every pod scales down", Observations(4, pods(*[(0.1, 0, 100, 1000)] * 4)), ON, 1, "ScaleDown",
         0.1),
    Case("a silent pod counts as zero load when ttft points up",
         Observations(2, pods((0.3, 1, 8000, 1000), (None, None, None, None))), ON, 4, "ScaleUpTtft", 8.0),
    Case("the scale-up window holds a ttft scale-up like any other",
         Observations(1, pods((0.3, 1, 3000, 500))), dataclasses.replace(ON, scale_up_window_s=30.0), 1,
         "StabilizingUp", 6.0,
         history=(Recommendation(990.0, 1),)),
    Case("clamped to maxReplicas", Observations(1, pods((0.3, 1, 300000, 500))), ON, 10, "ScaleUpTtft", 600.0),
    Case("pending pods stop a ttft scale-up", Observations(2, pods((0.3, 1, 3000, 500)), num_pending=1), ON, 2,
         "PendingPods", 6.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decisions(case: Case) -> None:
    decision = decide(case.obs, case.policy, case.history, 1000.0)
    assert (decision.desired, decision.reason) == (case.desired, case.reason), decision.message
    if case.ttft is None:
        assert decision.ttft_backlog_seconds is None
    else:
        assert decision.ttft_backlog_seconds == pytest.approx(case.ttft)


def test_the_message_names_the_winning_signal_its_value_and_target() -> None:
    decision = decide(Observations(1, pods((0.3, 1, 3000, 500))), ON, (), 1000.0)
    assert decision.message.startswith("ratio 3.00 by Ttft (")
    assert "kv 0.30/0.8" in decision.message and "queue 1.00/4" in decision.message
    assert "ttft backlog 6.00s/2s" in decision.message
    rec = decision.recommendation
    assert (rec.replicas, rec.reason) == (3, "ScaleUpTtft") and rec.message == decision.message
    unmeasured = decide(Observations(1, pods((0.3, 1, 3000, 0.0))), ON, (), 1000.0)
    assert "ttft backlog n/a" in unmeasured.message
    assert "ttft" not in decide(Observations(1, pods((0.3, 1, 3000, 500))), OFF, (), 1000.0).message


def test_recommendations_keep_their_reason_through_the_status() -> None:
    history = (Recommendation(1000.0, 3, "ScaleUpTtft", "ratio 3.00 by Ttft (...)"), Recommendation(1001.0, 2))
    written = status.recommendations_status(history)
    assert written[0]["reason"] == "ScaleUpTtft" and written[0]["message"].startswith("ratio 3.00 by Ttft")
    assert "reason" not in written[1]
    back = status.recommendations_from_status({"recommendations": written})
    assert [(r.replicas, r.reason, r.message) for r in back] == [(h.replicas, h.reason, h.message) for h in history]
    junk = status.recommendations_from_status(
        {"recommendations": [{"time": written[0]["time"], "replicas": 2, "reason": 7, "message": None}]})
    assert (junk[0].reason, junk[0].message) == ("", "")


@pytest.mark.parametrize(
    ("autoscaling", "expected"),
    [({}, None), ({"targetTtftSeconds": 2}, 2.0), ({"targetTtftSeconds": 0.5}, 0.5),
     ({"targetTtftSeconds": None}, None)],
)
def test_the_cr_field(autoscaling: dict[str, object], expected: float | None) -> None:
    spec = parse_spec("x", "ns", {"model": {"hostPath": {"path": "/m"}}, "autoscaling": autoscaling})
    assert spec.autoscaling.target_ttft_seconds == expected
    assert policy_of(spec).target_ttft_seconds == expected


@pytest.mark.parametrize("bad", [0, -1, "2s", True, math.inf, math.nan])
def test_the_cr_field_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="targetTtftSeconds"):
        parse_spec("x", "ns", {"model": {"hostPath": {"path": "/m"}}, "autoscaling": {"targetTtftSeconds": bad}})


def test_the_crd_schema_has_the_field_optional_and_positive() -> None:
    crd = yaml.safe_load((REPO / "crds" / "inflight.dev_inferencedeployments.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    field = schema["properties"]["spec"]["properties"]["autoscaling"]["properties"]["targetTtftSeconds"]
    assert field["type"] == "number" and "default" not in field and field["exclusiveMinimum"] is True
    assert "ttftBacklogSeconds" in schema["properties"]["status"]["properties"]
    doc = {"spec": {"model": {"hostPath": {"path": "/m"}}, "autoscaling": {"targetTtftSeconds": 0}}}
    assert list(jsonschema.Draft4Validator(schema).iter_errors(doc))


METRICS = """# TYPE inflight:kv_cache_usage_perc gauge
inflight:kv_cache_usage_perc{model_name="m"} 0.25
# TYPE inflight:num_requests_waiting gauge
inflight:num_requests_waiting{model_name="m"} 2.0
# TYPE inflight:num_prefill_backlog_tokens gauge
inflight:num_prefill_backlog_tokens{model_name="m"} 4096.0
# TYPE inflight:prefill_tokens_per_second gauge
inflight:prefill_tokens_per_second{model_name="m"} 1024.0
"""


def test_the_scrape_reads_the_backlog_and_the_rate() -> None:
    got = metrics_scrape.pod_metrics("p", METRICS)
    assert (got.kv_cache_usage, got.num_waiting) == (0.25, 2.0)
    assert (got.prefill_backlog_tokens, got.prefill_tokens_per_second) == (4096.0, 1024.0)
    assert got.ttft_backlog_seconds == 4.0
    old = metrics_scrape.pod_metrics("p", METRICS.split("# TYPE inflight:num_prefill")[0])
    assert old.prefill_backlog_tokens is None and old.ttft_backlog_seconds is None
    assert metrics_scrape.parse_metrics(METRICS) == (0.25, 2.0)
