"""The two HTTP sections of a run: the serving comparison (small model) and the roofline (medium).

``run_serving_section`` sends the burst and the Poisson points to every system, writes the
results table (burst), the Poisson table, the throughput-latency plot and the target
checks. ``run_roofline_section`` serves the medium model with the tuned inflight
configuration and compares its total tokens/s with ``matmul rate / (2 x parameters)``, the
rate measured in the same run. Knows nothing about argument parsing.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path
from typing import Any

from inflight.bench import report, roofline, serving, workloads
from inflight.bench.stats import Spread
from inflight.bench.suite import (
    PEER,
    SuiteOptions,
    bench_model,
    default_systems,
    load_points,
    write_fragment,
)
from inflight.bench.systems import SystemSpec
from inflight.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("inflight.bench")
Combined = dict[str, dict[str, dict[str, Spread]]]
OURS = ("inflight (defaults)", "inflight (tuned)")


def _poisson_table(combined: Combined, points: list[str]) -> str:
    header = ["system", *(f"{p}: out tok/s / TTFT p99 ms / TPOT p50 ms" for p in points)]
    rows = []
    for system, by_point in combined.items():
        cells = []
        for p in points:
            m = by_point.get(p)
            cells.append("-" if m is None else
                         f"{m['output_tok_s'].median:.0f} / {m['ttft_p99_s'].median * 1e3:.0f} / "
                         f"{m['tpot_p50_s'].median * 1e3:.1f}" + (f" ({m['errors'].median:.0f} err)"
                                                                  if m["errors"].median else ""))
        rows.append([system, *cells])
    return report.simple_table(header, rows)


def check_targets(burst: dict[str, dict[str, Spread]]) -> list[str]:
    """The issue's burst targets for each inflight configuration, against the strongest competitor."""
    peers = {k: v for k, v in burst.items() if k.startswith(PEER)}
    statics = {k: v for k, v in burst.items() if "static" in k}
    if not peers:
        return ["targets not checked: the peer has no burst result"]
    best_peer = max(peers, key=lambda k: peers[k]["output_tok_s"].median)
    lowest = min(peers, key=lambda k: peers[k]["ttft_p99_s"].median)
    lines = []
    for name in OURS:
        ours = burst.get(name)
        if ours is None:
            continue
        out = ours["output_tok_s"].median
        lines.append(_target(f"{name}: output tok/s >= 2x the best peer ({best_peer})",
                             out / peers[best_peer]["output_tok_s"].median, 2.0))
        for static in statics:
            lines.append(_target(f"{name}: output tok/s >= 3x {static}", out / statics[static]["output_tok_s"].median,
                                 3.0))
        ttft, peer_ttft = ours["ttft_p99_s"].median, peers[lowest]["ttft_p99_s"].median
        met = "met" if ttft <= peer_ttft else "MISSED"
        lines.append(f"- {name}: p99 TTFT no higher than the peer's lowest ({lowest}): {ttft * 1e3:.0f} ms vs "
                     f"{peer_ttft * 1e3:.0f} ms: **{met}**")
    return lines


def _target(label: str, ratio: float, goal: float) -> str:
    return f"- {label}: {ratio:.2f}x: **{'met' if ratio >= goal else 'MISSED'}**"


def log_dir(options: SuiteOptions) -> Path:
    """Server logs go next to, not into, the committed results."""
    return Path(tempfile.gettempdir()) / f"inflight-bench-logs-{options.results_dir.resolve().name}"


def run_serving_section(options: SuiteOptions, which: tuple[str, ...], engine_threads: int,
                        systems: tuple[SystemSpec, ...] | None = None) -> Combined:
    model = bench_model(options, "small")
    points = load_points(options, model, which)
    systems = systems or default_systems(options, engine_threads)
    plan = serving.ServingPlan(model, systems, points, options.reps, log_dir(options))
    errors: list[str] = []
    combined = serving.combine_raw(serving.run_serving(plan, errors.append))
    poisson = [p.name for p in points if not p.is_burst]
    md = serving_markdown(options, combined, poisson, errors)
    plot = options.results_dir / "throughput_latency.png"
    # Poisson points by rising rate, then the burst (the highest offered load).
    order = [*poisson, *(p.name for p in points if p.is_burst)]
    curves = {s: [by[name] for name in order if name in by] for s, by in combined.items()}
    report.plot_curves(curves, plot, "small model: throughput vs latency (burst + Poisson points)")
    md += [f"![throughput vs latency]({plot.name})", ""]
    record = {"systems": [s.name for s in systems], "points": [p.name for p in points],
              "results": {s: {p: report.spreads_to_json(m) for p, m in by.items()} for s, by in combined.items()},
              "errors": errors}
    write_fragment(options, "serving", "\n".join(md), record)
    return combined


def serving_markdown(options: SuiteOptions, combined: Combined, poisson: list[str], errors: list[str]) -> list[str]:
    """The serving fragment: burst table with ratios vs the strongest peer, targets, Poisson table."""
    md = [f"## Serving: small model ({options.burst.num_requests}-request burst, prompt/output lognormal "
          f"medians {options.burst.prompt_median}/{options.burst.output_median} tokens, sigma "
          f"{options.burst.sigma}; {options.reps} interleaved repetitions)", ""]
    burst = {s: p["burst"] for s, p in combined.items() if "burst" in p}
    peers = [s for s in burst if s.startswith(PEER)]
    if burst:
        peer = max(peers, key=lambda k: burst[k]["output_tok_s"].median) if peers else None
        md += [f"Ratios are against the peer configuration with the highest output tok/s ({peer}).", "",
               report.results_table(burst, peer), "", "Targets (burst, small model):", *check_targets(burst), ""]
    if poisson:
        md += [f"Poisson arrivals ({options.poisson.num_requests} requests per rate, medians):", "",
               _poisson_table(combined, poisson), ""]
    if errors:
        md += ["Failures:", *(f"- {e}" for e in errors), ""]
    return md


def run_roofline_section(options: SuiteOptions, engine_threads: int) -> dict[str, Any]:
    model = bench_model(options, "medium")
    num_params = roofline.num_parameters(model)
    rate_before = roofline.matmul_rate()
    cores = roofline.usable_cores()
    tuned = ("--max-num-sequences", "128", "--max-num-tokens", "512")
    systems = [SystemSpec(f"inflight (tuned), {engine_threads} thread(s)", "inflight", tuned)]
    if cores != engine_threads:
        systems.append(SystemSpec(f"inflight (tuned), {cores} threads", "inflight", tuned,
                                  env=(("INFLIGHT_CPU_THREADS", str(cores)),)))
    # Half the small-model burst (the medium model is ~8x slower per token), plus a
    # prefill-heavy point that shows the forward's matmul efficiency without decode attention.
    shape = dataclasses.replace(options.burst, num_requests=max(1, options.burst.num_requests // 2))
    tokenizer = load_tokenizer(model)
    prefill = workloads.WorkloadShape(32, 384, 4, 0.0, max_prompt=512)
    points = (serving.LoadPoint("burst", tuple(workloads.burst(tokenizer, shape, options.seed)), True),
              serving.LoadPoint("prefill-heavy", tuple(workloads.burst(tokenizer, prefill, options.seed)), True))
    plan = serving.ServingPlan(model, tuple(systems), points, options.reps, log_dir(options))
    combined = serving.combine_raw(serving.run_serving(plan))
    rate_after = roofline.matmul_rate()
    best = max((rate_before, rate_after), key=lambda r: r.best_gflops)
    roof = roofline.roofline_tok_s(best, num_params)
    rows = []
    for name, by_point in combined.items():
        for point, metrics in by_point.items():
            total = metrics["total_tok_s"]
            rows.append([name, point, report.fmt_spread(total, 1.0, "{:.0f}"), f"{roof:.0f}",
                         f"{100 * total.median / roof:.0f}% ({100 * total.lo / roof:.0f}-{100 * total.hi / roof:.0f})"])
    md = [f"## Roofline: medium model ({num_params:,} parameters)", "",
          f"Workloads: `burst` = {shape.num_requests} requests at once, prompt/output lognormal medians "
          f"{shape.prompt_median}/{shape.output_median} (sigma {shape.sigma}); `prefill-heavy` = 32 requests of "
          "~384 prompt tokens and 4 output tokens. Tuned config: --max-num-sequences 128 --max-num-tokens 512.", "",
          f"fp32 matmul rate measured in this run (1024^3, best thread count, best of before/after the "
          f"serving runs): {best.best_gflops:.0f} GFLOP/s at {best.best_threads} thread(s) (before: "
          f"{rate_before.by_threads}, after: {rate_after.by_threads}); roofline = rate / (2 x parameters) = "
          f"{roof:.0f} tok/s. Target: total tok/s >= 60% of it.", "",
          report.simple_table(("system", "workload", "total tok/s", "roofline tok/s", "share of roofline"), rows)]
    record = {"num_parameters": num_params, "rate_before": roofline.rate_to_dict(rate_before),
              "rate_after": roofline.rate_to_dict(rate_after), "roofline_tok_s": roof,
              "results": {s: {p: report.spreads_to_json(m) for p, m in by.items()} for s, by in combined.items()}}
    write_fragment(options, "roofline", "\n".join(md), record)
    return record
