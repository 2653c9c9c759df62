"""Inter-token gaps are observed in bulk (one update per bucket hit per step, not two locked
updates per streamed token) and read exactly as one ``observe`` per gap would."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from inflight.runtime.server.metrics import ServerMetrics
from inflight.runtime.server.request_metrics import INTER_TOKEN_LATENCY_BUCKETS, observe_many

# Below, on and above bucket edges, zero, negative and past the last finite bound.
AMOUNTS = [0.0, 0.009, 0.01, 0.0100001, 0.025, 0.07, 0.3, 0.3, 0.3, 1.0, 79.9, 80.0, 1e6, -0.5, 0.0123]


def _exposition(histogram_of: Callable[[Any], object]) -> str:
    registry = CollectorRegistry()
    histogram = Histogram("gap_seconds", "gaps", ["model_name"], registry=registry,
                          buckets=INTER_TOKEN_LATENCY_BUCKETS).labels("m")  # fmt: skip
    histogram_of(histogram)
    return "\n".join(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)


def test_observe_many_reads_as_one_observe_per_amount() -> None:
    one_by_one = _exposition(lambda h: [h.observe(a) for a in AMOUNTS])
    in_bulk = _exposition(lambda h: observe_many(h, AMOUNTS))
    assert in_bulk == one_by_one
    assert 'gap_seconds_count{model_name="m"} 15.0' in in_bulk  # it did observe them
    assert _exposition(lambda h: observe_many(h, [])) == _exposition(lambda h: None)


def _itl_count(metrics: ServerMetrics) -> float:
    for line in generate_latest(metrics.registry).decode().splitlines():  # no flush: what is observed now
        if line.startswith("inflight:inter_token_latency_seconds_count"):
            return float(line.rpartition(" ")[2])
    raise AssertionError("no inter-token latency histogram")


def test_gaps_without_a_loop_are_observed_at_once() -> None:
    metrics = ServerMetrics("m", lambda: None)
    metrics.observe_token_gap(0.02)
    assert _itl_count(metrics) == 1


def test_gaps_of_one_loop_turn_are_observed_together_after_it() -> None:
    metrics = ServerMetrics("m", lambda: None)

    async def one_step() -> tuple[float, float]:
        for gap in (0.01, 0.02, 0.03):  # three streams' tokens of one step
            metrics.observe_token_gap(gap)
        before = _itl_count(metrics)
        await asyncio.sleep(0)  # the loop runs the callbacks it had ready: the flush among them
        return before, _itl_count(metrics)

    before, after = asyncio.run(one_step())
    assert (before, after) == (0, 3)


def test_a_scrape_observes_the_gaps_still_pending() -> None:
    metrics = ServerMetrics("m", lambda: None)

    async def scrape_mid_step() -> str:
        metrics.observe_token_gap(0.01)
        metrics.observe_token_gap(0.5)
        return metrics.render().decode()

    text = asyncio.run(scrape_mid_step())
    assert 'inflight:inter_token_latency_seconds_count{model_name="m"} 2.0' in text
    assert 'inflight:inter_token_latency_seconds_sum{model_name="m"} 0.51' in text
