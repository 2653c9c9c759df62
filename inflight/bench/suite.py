"""The suite: which systems, workloads and sizes a benchmark run uses, and writing its results.

Owns the benchmark models (made with the demo-model maker when absent: llama, no reachable
EOS so every request generates exactly ``max_tokens``), the default systems, and each
section (serving, overhead, sweep, roofline) as a function that measures and writes its
markdown fragment and JSON under the results directory. ``write_summary`` stitches the
fragments present into ``RESULTS.md``. Knows nothing about argument parsing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.bench import overhead, report, roofline, serving, sweep, workloads
from inflight.bench.systems import SystemSpec

logger = logging.getLogger("inflight.bench")
PEER = "transformers serve --continuous-batching"
SECTIONS = ("machine", "serving", "peers", "roofline", "overhead", "sweep")


@dataclass(frozen=True, slots=True)
class SuiteOptions:
    results_dir: Path = Path("bench/results")
    models_dir: Path = Path("models")
    reps: int = 2
    burst: workloads.WorkloadShape = workloads.WorkloadShape(128, 96, 64, 0.8, max_prompt=384, max_output=256)
    poisson: workloads.WorkloadShape = workloads.WorkloadShape(24, 96, 64, 0.8, max_prompt=384, max_output=256)
    rates: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0)
    static_batch_size: int = 16
    overhead_sizes: tuple[int, ...] = (1, 64, 256)
    seed: int = 0


def bench_model(options: SuiteOptions, size: str) -> Path:
    """``models/bench-<size>`` (llama, never stops on EOS), made on first use."""
    path = options.models_dir / f"bench-{size}"
    if not (path / "config.json").exists():
        from inflight.runtime.demo.model import make_demo_model

        logger.info("making the %s benchmark model in %s", size, path)
        make_demo_model(path, "llama", size, options.seed, eos=False)
    return path


def default_systems(options: SuiteOptions, engine_threads: int) -> tuple[SystemSpec, ...]:
    same_threads = (("OMP_NUM_THREADS", str(engine_threads)),)
    return (
        SystemSpec("inflight (defaults)", "inflight"),
        SystemSpec("inflight (tuned)", "inflight", ("--max-num-sequences", "128", "--max-num-tokens", "512")),
        SystemSpec("inflight --scheduler-policy static", "inflight", ("--scheduler-policy", "static")),
        SystemSpec(PEER, "transformers-serve", env=same_threads),
        SystemSpec(f"{PEER} (torch default threads)", "transformers-serve"),
        SystemSpec(f"transformers generate, static batches of {options.static_batch_size}", "hf-generate",
                   env=same_threads, batch_size=options.static_batch_size),
    )


def load_points(options: SuiteOptions, model_dir: Path, which: tuple[str, ...]) -> tuple[serving.LoadPoint, ...]:
    from inflight.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    points = []
    if "burst" in which:
        points.append(serving.LoadPoint("burst", tuple(workloads.burst(tokenizer, options.burst, options.seed)), True))
    if "poisson" in which:
        for rate in options.rates:
            specs = workloads.poisson(tokenizer, options.poisson, rate, options.seed)
            points.append(serving.LoadPoint(f"poisson@{rate:g}/s", tuple(specs), False))
    return tuple(points)


def write_fragment(options: SuiteOptions, name: str, markdown: str, record: dict[str, Any]) -> None:
    options.results_dir.mkdir(parents=True, exist_ok=True)
    (options.results_dir / f"{name}.md").write_text(markdown.rstrip() + "\n")
    report.write_json(options.results_dir / f"{name}.json", record)


def write_summary(options: SuiteOptions) -> Path:
    """``RESULTS.md``: every fragment present, in section order."""
    parts = ["# inflight benchmark results", "",
             "Written by `python -m inflight.bench` (see `inflight/bench/`). Medians over interleaved "
             "repetitions, (min-max) in brackets.", ""]
    for name in SECTIONS:
        path = options.results_dir / f"{name}.md"
        if path.exists():
            parts += [path.read_text(), ""]
    out = options.results_dir / "RESULTS.md"
    out.write_text("\n".join(parts))
    return out


def run_machine(options: SuiteOptions) -> dict[str, Any]:
    dirs = {s: bench_model(options, s) for s in ("small", "medium")}
    facts = roofline.machine_facts(dirs)
    rate = roofline.matmul_rate()
    facts["matmul_gflops_by_threads"] = rate.by_threads
    lines = ["## Machine", "", report.simple_table(("fact", "value"), [
        ("CPU", facts["cpu_model"]), ("usable cores", facts["usable_cores"]),
        ("engine torch threads (default policy)", facts["engine_torch_threads"]),
        ("load average at start (1/5/15 min)", facts["load_average"]),
        ("fp32 matmul GFLOP/s by threads (1024^3, median)",
         ", ".join(f"{t}: {g:.0f}" for t, g in rate.by_threads.items())),
        ("torch / transformers", f"{facts['torch']} / {facts['transformers']}"),
        *((f"model {n} parameters", f"{m['parameters']:,} (hidden {m['hidden_size']}, {m['num_layers']} layers)")
          for n, m in facts["models"].items()),
    ])]
    write_fragment(options, "machine", "\n".join(lines), facts)
    return facts


def run_overhead(options: SuiteOptions) -> list[overhead.OverheadResult]:
    model = bench_model(options, "small")
    results = [overhead.measure(model, n) for n in options.overhead_sizes]
    md = ["## Scheduler overhead (small model, in-process engine, decode steps)", "",
          "Time per step outside the model forward (`runner.execute`: decoder + LM head), median "
          "over 8 steps, (min-max) of the share.", "",
          report.simple_table(overhead.TABLE_HEADER, overhead.table_rows(results))]
    write_fragment(options, "overhead", "\n".join(md), {"results": [_slots_dict(r) for r in results]})
    return results


def run_sweep(options: SuiteOptions) -> list[sweep.SweepCell]:
    from inflight.runtime.tokenizer import load_tokenizer

    model = bench_model(options, "small")
    shape = options.poisson
    specs = workloads.burst(load_tokenizer(model), shape, options.seed)
    cells = sweep.run_sweep(model, specs, sweep.DEFAULT_BLOCK_SIZES, sweep.DEFAULT_MAX_NUM_TOKENS, 64)
    md = [f"## Tuning sweep: block size x max_num_tokens (small model, in-process engine, burst of "
          f"{shape.num_requests}, max_num_sequences 64, one run per cell)", "",
          report.simple_table(sweep.TABLE_HEADER, sweep.table_rows(cells))]
    write_fragment(options, "sweep", "\n".join(md), {"cells": [_slots_dict(c) for c in cells]})
    return cells


def _slots_dict(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}
