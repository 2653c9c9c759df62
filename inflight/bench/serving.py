"""The serving comparison: the same load points against every system, repetitions interleaved.

A load point is a named workload (the burst, or Poisson arrivals at one rate). Each
repetition starts every system in turn (rotating the order each repetition so that no
system always runs first or last), sends it every load point, and stops it; per system and
point the repetitions are combined into medians with min-max. Each run also records the
machine's load average at its start and the CPU time stolen during it, and each server's turn
its start-up, first request and process layout (:mod:`inflight.bench.run_context`). The
in-process ``generate`` baseline only takes burst points (its static batches assume everything
has arrived). Knows nothing about files or plots.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from inflight.bench import hf_static, run_context
from inflight.bench.client import RequestSpec, RunResult, greedy_text, run_workload
from inflight.bench.stats import RunSummary, Spread, combine, summarize
from inflight.bench.systems import RunningServer, SystemSpec

logger = logging.getLogger("inflight.bench")


@dataclass(frozen=True, slots=True)
class LoadPoint:
    name: str  # "burst" or "poisson@4.0"
    specs: tuple[RequestSpec, ...]
    is_burst: bool


@dataclass(frozen=True, slots=True)
class ServingPlan:
    model_dir: Path
    systems: tuple[SystemSpec, ...]
    points: tuple[LoadPoint, ...]
    reps: int
    log_dir: Path
    request_timeout_s: float = 600.0
    probe: RequestSpec | None = None  # sent greedily once per server (first repetition): agreement check


@dataclass(frozen=True, slots=True)
class ServerTurn:
    """One server's turn in one repetition: seconds from its start to ready and for its warm-up
    request (both outside the measurement), and its process layout after its load points."""

    rep: int
    startup_s: float
    first_request_s: float
    layout: run_context.ServerLayout | None


Raw = dict[str, dict[str, list[RunSummary]]]  # system -> point -> one summary per repetition
Probes = dict[str, str]  # system -> greedy completion text of plan.probe
Turns = dict[str, list[ServerTurn]]  # system -> one per repetition it started in


def _run_server(spec: SystemSpec, plan: ServingPlan, rep: int, raw: Raw, probes: Probes, turns: Turns) -> None:
    log = plan.log_dir / f"{spec.name.replace(' ', '_').replace('/', '_')}.rep{rep}.log"
    with RunningServer(spec, plan.model_dir, log) as server:
        if plan.probe is not None and spec.name not in probes:
            probes[spec.name] = greedy_text(server.url, server.model_name, plan.probe)
        for point in plan.points:
            cpu_before, load, ticks = server.cpu_seconds(), run_context.load_1m(), run_context.cpu_times()
            run = run_workload(server.url, server.model_name, list(point.specs), plan.request_timeout_s)
            _record(raw, spec, point, run, server.cpu_seconds() - cpu_before,
                    load, run_context.steal_fraction(ticks, run_context.cpu_times()))
        layout = run_context.server_layout(server.proc.pid) if server.proc is not None else None
        turns.setdefault(spec.name, []).append(ServerTurn(rep, server.startup_s, server.first_request_s, layout))


def _run_in_process(spec: SystemSpec, plan: ServingPlan, raw: Raw, loaded: dict[str, object]) -> None:
    if "model" not in loaded:
        loaded["model"], loaded["tokenizer"] = hf_static.load(plan.model_dir)
        hf_static.warm_up(loaded["model"], loaded["tokenizer"])
    threads = dict(spec.env).get("OMP_NUM_THREADS")
    before = torch.get_num_threads()
    torch.set_num_threads(int(threads) if threads else before)
    try:
        for point in plan.points:
            if point.is_burst:
                run = hf_static.run_static_generate(loaded["model"], loaded["tokenizer"], list(point.specs),
                                                    spec.batch_size)
                _record(raw, spec, point, run)
    finally:
        torch.set_num_threads(before)


def _record(raw: Raw, spec: SystemSpec, point: LoadPoint, run: RunResult, cpu_s: float | None = None,
            load: float = float("nan"), steal: float = float("nan")) -> None:
    summary = dataclasses.replace(summarize(run, cpu_s), load_1m=load, steal_frac=steal)
    raw.setdefault(spec.name, {}).setdefault(point.name, []).append(summary)
    logger.info("%-40s %-14s out %7.1f tok/s  ttft p99 %7.0f ms  tpot p50 %6.1f ms  errors %d  (%.1fs)",
                spec.name, point.name, summary.output_tok_s, summary.ttft_p99_s * 1e3,
                summary.tpot_p50_s * 1e3, summary.errors, summary.wall_s)


def run_serving(plan: ServingPlan, on_error: Callable[[str], None] | None = None,
                probes: Probes | None = None, between: Callable[[], None] | None = None,
                turns: Turns | None = None) -> Raw:
    """Every system x every point x ``plan.reps``, interleaved. A system that fails to start is
    reported through ``on_error`` and skipped for that repetition; the others still run. With
    ``plan.probe``, each server's greedy completion of it lands in ``probes``. ``between`` runs
    after each system's turn (its server stopped), e.g. to sample the machine's matmul rate.
    Each server's turn lands in ``turns``."""
    probes = {} if probes is None else probes
    turns = {} if turns is None else turns
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    raw: Raw = {}
    loaded: dict[str, object] = {}
    systems = list(plan.systems)
    for rep in range(plan.reps):
        shift = rep % len(systems)
        for spec in systems[shift:] + systems[:shift]:
            try:
                if spec.in_process:
                    _run_in_process(spec, plan, raw, loaded)
                else:
                    _run_server(spec, plan, rep, raw, probes, turns)
            except (RuntimeError, TimeoutError, OSError) as exc:
                message = f"{spec.name} (rep {rep}): {exc}"
                logger.error("%s", message)
                if on_error:
                    on_error(message)
            if between is not None:
                between()
    return raw


def combine_raw(raw: Raw) -> dict[str, dict[str, dict[str, Spread]]]:
    """system -> point -> metric -> median (min-max) over repetitions."""
    return {system: {point: combine(runs) for point, runs in points.items()} for system, points in raw.items()}
