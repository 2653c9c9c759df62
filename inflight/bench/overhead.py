"""Scheduler-overhead probe: the share of an engine step spent outside the model forward.

Builds an in-process :class:`LLMEngine`, fills it with ``num_running`` decoding sequences
(short prompts, long outputs), then times decode steps. The scheduler, the batch
preparation, the forward (``runner.execute``: decoder + LM head) and the sampler are timed
by wrapping those methods on the instances; what is left of the step is stop checks,
and output building (token ids: the engine makes no text). Overhead = step - forward. Knows nothing about servers.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams

PHASES = ("schedule", "prepare", "forward", "sample")


@dataclass(frozen=True, slots=True)
class OverheadResult:
    num_running: int
    step_ms: float  # median over the timed steps
    phase_ms: dict[str, float]  # median per phase, plus "other"
    overhead_frac: float  # median of (step - forward) / step
    overhead_frac_lo: float
    overhead_frac_hi: float


class _PhaseTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - t0

        return timed

    def reset(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)


def build_engine(model_dir: Path, num_running: int, block_size: int = 16) -> tuple[LLMEngine, _PhaseTimer]:
    config = EngineConfig(max_num_sequences=num_running, max_model_len=256, block_size=block_size)
    engine = LLMEngine.from_model_dir(model_dir, config)
    engine.warmup()
    timer = _PhaseTimer()
    engine.scheduler.schedule = timer.wrap("schedule", engine.scheduler.schedule)  # type: ignore[method-assign]
    engine.runner.prepare = timer.wrap("prepare", engine.runner.prepare)  # type: ignore[method-assign]
    engine.runner.execute = timer.wrap("forward", engine.runner.execute)  # type: ignore[method-assign]
    engine.sampler.sample = timer.wrap("sample", engine.sampler.sample)  # type: ignore[method-assign]
    return engine, timer


def measure(model_dir: Path, num_running: int, num_steps: int = 8, prompt_len: int = 16) -> OverheadResult:
    """Median phase times over ``num_steps`` decode steps with ``num_running`` sequences."""
    engine, timer = build_engine(model_dir, num_running)
    rng = random.Random(num_running)
    vocab = engine.runner.spec.vocab_size
    params = SamplingParams(max_tokens=num_steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(num_running):
        engine.add_request(f"r{i}", [rng.randrange(8, vocab) for _ in range(prompt_len)], params)
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # one plain decode step before timing
    steps, fracs, phases = [], [], {p: [] for p in (*PHASES, "other")}
    for _ in range(num_steps):
        timer.reset()
        t0 = time.perf_counter()
        engine.step()
        step = time.perf_counter() - t0
        steps.append(step)
        fracs.append((step - timer.totals["forward"]) / step)
        for p in PHASES:
            phases[p].append(timer.totals[p])
        phases["other"].append(step - sum(timer.totals.values()))
    if engine.scheduler.num_running != num_running:
        raise RuntimeError(f"expected {num_running} running sequences, had {engine.scheduler.num_running}")
    return OverheadResult(
        num_running=num_running, step_ms=statistics.median(steps) * 1e3,
        phase_ms={p: statistics.median(v) * 1e3 for p, v in phases.items()},
        overhead_frac=statistics.median(fracs), overhead_frac_lo=min(fracs), overhead_frac_hi=max(fracs),
    )


def table_rows(results: list[OverheadResult]) -> list[list[str]]:
    rows = []
    for r in results:
        phases = [f"{r.phase_ms[p]:.2f}" for p in (*PHASES, "other")]
        frac = f"{100 * r.overhead_frac:.1f}% ({100 * r.overhead_frac_lo:.1f}-{100 * r.overhead_frac_hi:.1f})"
        rows.append([str(r.num_running), f"{r.step_ms:.2f}", *phases, frac])
    return rows


TABLE_HEADER = ("running seqs", "step ms", "schedule ms", "prepare ms", "forward ms", "sample ms",
                "other ms (stop/detok/outputs)", "outside forward, % of step")
