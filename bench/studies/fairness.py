"""``python -m bench.studies.fairness``: one tenant's flood against another's few requests.

Serves the small bench model with ``--scheduler-policy fcfs`` and ``fair``, repetitions
interleaved. Tenant A (``user: a``) sends 64 long requests at once; 0.5 s later tenant B
(``user: b``) sends 4 short ones. Reports B's TTFT p99 under each policy and B's TTFT p99 when
it is alone (and their ratio per repetition, both measured on the same server), and the total
output tok/s of the mixed run. Under ``fair`` one tenant puts at most ``--max-num-tokens`` / 8
prompt tokens into a step (``--long-prefill-token-threshold``), so B arrives during a short
step and boards at the next one, ahead of A's prompt chunks. Writes ``fairness.md`` / ``.json``
under the results directory. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
from pathlib import Path

from inflight.bench import report, workloads
from inflight.bench.client import RequestSpec, run_workload
from inflight.bench.stats import summarize
from inflight.bench.suite import SuiteOptions, bench_model
from inflight.bench.systems import RunningServer, SystemSpec

SYSTEMS = (SystemSpec("fcfs", "inflight"), SystemSpec("fair", "inflight", ("--scheduler-policy", "fair")))


def _p99(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.99 * len(values)) - 1)] if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.fairness", description=__doc__)
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    load = os.getloadavg()
    model_dir = bench_model(SuiteOptions(models_dir=args.models_dir), "small")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    flood = [RequestSpec(s.prompt, 192, 0.0, "a") for s in
             workloads.burst(tokenizer, workloads.WorkloadShape(64, 256, 192, 0.2, max_prompt=512))]  # fmt: skip
    few = [RequestSpec(s.prompt, 16, 0.5, "b") for s in
           workloads.burst(tokenizer, workloads.WorkloadShape(4, 32, 16, 0.2), seed=1)]  # fmt: skip
    alone = [RequestSpec(s.prompt, s.max_tokens, 0.0, "b") for s in few]
    figures: dict[str, dict[str, list[float]]] = {s.name: {} for s in SYSTEMS}
    log_dir = Path("bench/.work/fairness_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    for rep in range(args.reps):
        for spec in (SYSTEMS if rep % 2 == 0 else SYSTEMS[::-1]):
            with RunningServer(spec, model_dir, log_dir / f"{spec.name}.rep{rep}.log") as server:
                b_alone = run_workload(server.url, server.model_name, alone)
                mixed = run_workload(server.url, server.model_name, flood + few)
            b_ttft = [r.ttft_s for r in mixed.results[len(flood):] if r.ttft_s is not None]
            entry = figures[spec.name]
            entry.setdefault("b_ttft_p99_s", []).append(_p99(b_ttft))
            entry.setdefault("b_alone_ttft_p99_s", []).append(_p99([r.ttft_s for r in b_alone.results if r.ttft_s]))
            entry.setdefault("out_tok_s", []).append(summarize(mixed).output_tok_s)
            entry.setdefault("b_ttft_ratio", []).append(entry["b_ttft_p99_s"][-1] / entry["b_alone_ttft_p99_s"][-1])
            logging.info("%s rep %d: %s", spec.name, rep, {k: v[-1] for k, v in entry.items()})
    med = {name: {k: statistics.median(v) for k, v in f.items()} for name, f in figures.items()}
    rows = [[name, f"{1e3 * m['b_ttft_p99_s']:.0f}", f"{1e3 * m['b_alone_ttft_p99_s']:.0f}",
             f"{m['out_tok_s']:.0f}"] for name, m in med.items()]  # fmt: skip
    table = report.simple_table(["policy", "B TTFT p99 ms (behind A's flood)", "B TTFT p99 ms (alone)",
                                 "mixed run out tok/s"], rows)  # fmt: skip
    fair, fcfs = med["fair"], med["fcfs"]
    paired = ", ".join(f"{r:.2f}x" for r in figures["fair"]["b_ttft_ratio"])
    text = (f"# Fair sharing: 64 long requests from tenant A, then 4 short ones from tenant B\n\nSmall bench model "
            f"on this CPU (load average at start {load[0]:.1f}), {args.reps} interleaved repetitions (medians).\n\n"
            f"{table}\n\nWith fair: B's TTFT p99 is "
            f"{fair['b_ttft_p99_s'] / fair['b_alone_ttft_p99_s']:.1f}x B alone (per repetition, same server: {paired}; "
            f"max {max(figures['fair']['b_ttft_ratio']):.2f}x) (target <= 2x; FCFS: "
            f"{fcfs['b_ttft_p99_s'] / fcfs['b_alone_ttft_p99_s']:.1f}x); total output {fair['out_tok_s'] / fcfs['out_tok_s']:.3f}x "
            f"FCFS's (target >= 0.95x).\n")  # fmt: skip
    print("\n" + text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "fairness.md").write_text(text)
    report.write_json(args.results_dir / "fairness.json", {"runs": figures, "medians": med, "load_average": load})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
