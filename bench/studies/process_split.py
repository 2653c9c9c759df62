"""``python -m bench.studies.process_split``: the engine-core process against one process.

Measures side by side, repetitions interleaved, on the small bench model: ``inflight serve``
(front end + engine-core process) and ``inflight serve --single-process`` (the engine in a
thread of the server) on a 64-request burst (output tok/s, server cores used) and Poisson
arrivals at 4 requests/s (TPOT p50, TTFT p99); and the message protocol's own cost per step at
64 running sequences: one :class:`StepDone` with 64 outputs pickled, sent through a pipe and
read by another process, against an engine step of 64 decodes measured in the same run.
Writes ``process_split.md`` / ``.json`` under the results directory. Knows nothing about the
server's internals.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import statistics
import time
from pathlib import Path

from inflight.bench import report, serving, workloads
from inflight.bench.suite import SuiteOptions, bench_model
from inflight.bench.systems import SystemSpec
from inflight.runtime.engine_core import protocol as p
from inflight.runtime.outputs import EngineStats, RequestOutput

NUM_SEQS = 64
SYSTEMS = (SystemSpec("inflight (engine-core process)", "inflight"),
           SystemSpec("inflight --single-process", "inflight", ("--single-process",)))  # fmt: skip


def _step_message(num_seqs: int) -> p.StepDone:
    outputs = tuple(RequestOutput(f"cmpl-{i:08x}-0", (1000 + i,), " word", False, None, 96, 40 + i, 0)
                    for i in range(num_seqs))  # fmt: skip
    stats = EngineStats(num_seqs, 0, 4096, 900, 0, 0, 0, 6144, 2560, num_seqs, 100, num_seqs)
    return p.step_done(outputs, stats)


def _echo(conn) -> None:  # noqa: ANN001 - the child end of a pipe
    while (message := conn.recv()) is not None:
        conn.send(len(message))


def protocol_ms_per_step(num_seqs: int = NUM_SEQS, reps: int = 500) -> float:
    """Milliseconds to send one step's outputs to another process and have them read there
    (half a round trip: a reply of one int comes back, which costs about the same as a read)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(child,), daemon=True)
    proc.start()
    message = _step_message(num_seqs)
    for _ in range(20):
        parent.send(message)
        parent.recv()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        parent.send(message)
        parent.recv()
        times.append(time.perf_counter() - t0)
    parent.send(None)
    proc.join(10)
    return 1e3 * statistics.median(times)


def engine_step_ms(model_dir: Path) -> float:
    from bench.gpu.engine import time_decode_steps
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine

    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(device="cpu", max_num_sequences=NUM_SEQS,
                                                              num_kv_blocks=1024))  # fmt: skip
    seconds, _ = time_decode_steps(engine, NUM_SEQS, 4000, device="cpu")
    return 1e3 * seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.process_split", description=__doc__)
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--burst-requests", type=int, default=NUM_SEQS)
    parser.add_argument("--poisson-requests", type=int, default=24)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    options = SuiteOptions(results_dir=args.results_dir, models_dir=args.models_dir, reps=args.reps)
    model_dir = bench_model(options, "small")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    burst_shape = workloads.WorkloadShape(args.burst_requests, 96, 64, 0.8, max_prompt=384, max_output=256)
    poisson_shape = workloads.WorkloadShape(args.poisson_requests, 96, 64, 0.8, max_prompt=384, max_output=256)
    points = (serving.LoadPoint("burst", tuple(workloads.burst(tokenizer, burst_shape)), True),
              serving.LoadPoint("poisson@4.0", tuple(workloads.poisson(tokenizer, poisson_shape, 4.0)), False))  # fmt: skip
    plan = serving.ServingPlan(model_dir, SYSTEMS, points, args.reps, Path("bench/.work/process_split_logs"))
    combined = serving.combine_raw(serving.run_serving(plan))
    protocol_ms = protocol_ms_per_step()
    step_ms = engine_step_ms(model_dir)
    rows = []
    for spec in SYSTEMS:
        burst, poisson = combined[spec.name]["burst"], combined[spec.name]["poisson@4.0"]
        rows.append([spec.name, report.fmt_spread(burst["output_tok_s"]),
                     report.fmt_spread(burst["cores_used"], pattern="{:.2f}"),
                     report.fmt_spread(poisson["tpot_p50_s"], 1e3), report.fmt_spread(poisson["ttft_p99_s"], 1e3)])
    table = report.simple_table(["system", "burst out tok/s", "burst cores used", "Poisson 4/s TPOT p50 ms",
                                 "Poisson 4/s TTFT p99 ms"], rows)  # fmt: skip
    text = (f"# Engine-core process vs one process\n\nSmall bench model on this CPU, {args.reps} interleaved "
            f"repetitions, median (min-max).\n\n{table}\n\nMessage protocol: {protocol_ms:.3f} ms to hand a "
            f"{NUM_SEQS}-sequence step's outputs to the front end, against an engine step of {NUM_SEQS} decodes of "
            f"{step_ms:.1f} ms ({100 * protocol_ms / step_ms:.1f}% of the step).\n")  # fmt: skip
    print("\n" + text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "process_split.md").write_text(text)
    report.write_json(args.results_dir / "process_split.json", {
        "protocol_ms_per_step": protocol_ms, "engine_step_ms": step_ms,
        "systems": {s.name: {pt: report.spreads_to_json(m) for pt, m in combined[s.name].items()} for s in SYSTEMS},
    })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
