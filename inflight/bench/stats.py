"""Summaries: one run's throughput and latency percentiles, and medians (min-max) over repetitions.

Throughput counts the tokens each server reports in ``usage`` over the run's wall time
(first send to last response); failed requests count as errors and add no tokens. TPOT is
per request ``(e2e - ttft) / (output_tokens - 1)``. Knows nothing about servers or files.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from inflight.bench.client import RunResult

METRICS = ("output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
           "e2e_p50_s", "e2e_p99_s", "gap_p99_s", "errors", "cores_used")


@dataclass(frozen=True, slots=True)
class RunSummary:
    output_tok_s: float
    total_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    gap_p99_s: float  # p99 of every inter-token gap of every request
    errors: int
    num_requests: int
    wall_s: float
    cores_used: float = float("nan")  # server CPU seconds / wall seconds (NaN: not measured)
    load_1m: float = float("nan")  # the machine's 1-minute load average when the run started
    steal_frac: float = float("nan")  # share of the machine's CPU time stolen during the run


@dataclass(frozen=True, slots=True)
class Spread:
    """Median over repetitions with the min and max."""

    median: float
    lo: float
    hi: float


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100]; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(run: RunResult, cpu_s: float | None = None) -> RunSummary:
    """Latency percentiles and rates of one run; ``cpu_s``: the server's CPU seconds during it."""
    ok = [r for r in run.results if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    gaps = [g for r in ok for g in r.gaps_s]
    out_tokens = sum(r.num_output_tokens for r in ok)
    all_tokens = out_tokens + sum(r.num_prompt_tokens for r in ok)
    wall = max(run.wall_s, 1e-9)
    return RunSummary(
        output_tok_s=out_tokens / wall, total_tok_s=all_tokens / wall,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
        e2e_p50_s=percentile(e2e, 50), e2e_p99_s=percentile(e2e, 99), gap_p99_s=percentile(gaps, 99),
        errors=len(run.results) - len(ok), num_requests=len(run.results), wall_s=run.wall_s,
        cores_used=float("nan") if cpu_s is None else cpu_s / wall,
    )


def spread(values: list[float]) -> Spread:
    return Spread(statistics.median(values), min(values), max(values))


def combine(runs: list[RunSummary]) -> dict[str, Spread]:
    """Per metric, the median (min-max) over repetitions."""
    if not runs:
        raise ValueError("no runs to combine")
    return {m: spread([float(getattr(r, m)) for r in runs]) for m in METRICS}


def to_dict(summary: RunSummary) -> dict[str, float]:
    return dataclasses.asdict(summary)
