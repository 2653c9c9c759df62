"""Core-step bench: the engine core's host microseconds per row per step on the simulated device.

``python -m bench.studies.core_step [--rows 64 256 512] [--tokens 64] [--reps 2] [--async]``
builds an offline :class:`LLMEngine` on the tiny demo model with ``device="sim"`` and a zero
step-time profile (the device costs nothing, so every microsecond measured is the host's),
adds N greedy requests that decode M tokens each (``--tokens`` up to ~990: the context, and
so each row's block table, grows with it), and prints the host microseconds per row
per step over the decode steps, split coarsely into schedule / prepare (packing the batch) /
execute (the simulated forward and its sampling) / process (stop rules and outputs) / other.
Times are CPU time (the engine thread's, ``time.thread_time``), so other load on a shared
machine inflates them less than wall time would. ``--async`` measures the same engine under
async scheduling: the whole process's CPU time (the step worker thread's included), total only.
``--freeze-gc`` settles the garbage collector after the warm-up as the engine-core process of
``inflight serve`` does (:func:`~inflight.runtime.engine_core.process_gc.settle_for_serving`: what is alive
frozen, a young-generation threshold above a step's temporaries): without it a full collection,
which scans every object of torch and transformers (~0.5 s on a 2-core machine), lands in some
runs' steps and not others', and young-generation passes run mid-step. Repetitions of a size run back to back on one engine after its warm-up; the table gives the
median. No server, no HTTP, no clients: what is left is the core's own per-step work.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.engine_core.process_gc import settle_for_serving
from inflight.runtime.sampling_params import SamplingParams

WORK = Path("bench/.work/core-step")
PARTS = ("schedule", "prepare", "execute", "process")


def _timed(totals: dict[str, float], part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[part] += time.thread_time() - started

    return wrapper


def _instrument(engine: LLMEngine, totals: dict[str, float]) -> None:
    """Time the engine's coarse parts by wrapping them on the instance (the code runs unchanged)."""
    engine.schedule = _timed(totals, "schedule", engine.schedule)  # type: ignore[method-assign]
    engine.runner.prepare = _timed(totals, "prepare", engine.runner.prepare)  # type: ignore[method-assign]
    engine.runner.execute = _timed(totals, "execute", engine.runner.execute)  # type: ignore[method-assign]
    engine.sampler.sample = _timed(totals, "execute", engine.sampler.sample)  # type: ignore[method-assign]
    proc = engine.output_processor
    proc.process = _timed(totals, "process", proc.process)  # type: ignore[method-assign]


def _one_burst(engine: LLMEngine, num_rows: int, num_tokens: int, totals: dict[str, float]) -> tuple[float, int]:
    """CPU seconds in decode steps and rows they ran (the admission step left out)."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_rows):
        engine.add_request(f"r{i}", engine.encode_prompt(f"request {i}: def f(x):"), params)
    engine.step()  # admission and prompts: not a decode step
    if engine.pipeline is not None:
        engine.step()
    totals.clear()
    clock = time.process_time if engine.pipeline is not None else time.thread_time
    elapsed, rows = 0.0, 0
    while engine.has_unfinished_requests():
        running = engine.scheduler.num_running
        started = clock()
        engine.step()
        elapsed += clock() - started
        rows += running
    return elapsed, rows


def run(sizes: list[int], num_tokens: int, reps: int, async_scheduling: bool, freeze_gc: bool = False) -> list[str]:
    model_dir = WORK / "llama-tiny"
    if not (model_dir / "config.json").exists():
        make_demo_model(model_dir, "llama", "tiny", eos=False)
    profile = WORK / "zero-profile.json"
    profile.write_text(json.dumps({"base_ms": 0, "decode_row_ms": 0, "prefill_token_ms": 0,
                                   "attention_ms_per_1k_context": 0}))
    mode = ("async scheduling" if async_scheduling else "synchronous") + (", gc frozen" if freeze_gc else "")
    lines = [f"core step, device sim (zero step time), {mode}: N greedy rows x {num_tokens} tokens, "
             f"median of {reps}; host CPU us per row per step", "",
             "| rows | total | " + " | ".join(PARTS) + " | other |", "|---:|---:|" + "---:|" * (len(PARTS) + 1)]
    for num_rows in sizes:
        config = EngineConfig(device="sim", sim_profile=str(profile), max_num_sequences=num_rows,
                              max_num_tokens=max(2048, 16 * num_rows), max_model_len=max(256, num_tokens + 32),
                              async_scheduling=async_scheduling)  # fmt: skip
        engine = LLMEngine.from_model_dir(model_dir, config)
        engine.warmup()
        thresholds = gc.get_threshold()
        if freeze_gc:
            settle_for_serving()
        totals: dict[str, float] = defaultdict(float)
        if not async_scheduling:
            _instrument(engine, totals)
        per_row: dict[str, list[float]] = defaultdict(list)
        for _ in range(reps):
            elapsed, rows = _one_burst(engine, num_rows, num_tokens, totals)
            per_row["total"].append(elapsed / rows * 1e6)
            for part in PARTS:
                per_row[part].append(totals[part] / rows * 1e6)
            per_row["other"].append((elapsed - sum(totals[p] for p in PARTS)) / rows * 1e6)
        engine.close()
        if freeze_gc:
            gc.unfreeze()
            gc.set_threshold(*thresholds)
        cells = [statistics.median(per_row[k]) for k in ("total", *PARTS, "other")]
        if async_scheduling:
            lines.append(f"| {num_rows} | {cells[0]:.1f} |" + " - |" * (len(PARTS) + 1))
        else:
            lines.append(f"| {num_rows} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[64, 256, 512])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--async", dest="async_scheduling", action="store_true")
    parser.add_argument("--freeze-gc", action="store_true")
    args = parser.parse_args()
    print("\n".join(run(args.rows, args.tokens, args.reps, args.async_scheduling, args.freeze_gc)))


if __name__ == "__main__":
    main()
