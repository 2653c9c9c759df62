"""``python -m bench.studies.host_path``: the host path against a simulated device (issue 47).

Serves the demo model with ``inflight serve --device sim`` and a fixed simulated step time
(``--sim-profile``: every step takes ``--step-ms``, whatever its rows), fires a streaming burst
of N streams x exactly M tokens (``ignore_eos``) with the bench client, and prints per burst: device busy % (the rate
of ``inflight:device_busy_seconds_total`` over the burst's wall time, NVML's definition),
delivered output tok/s against the ideal (rows / step time, rows = min(N, the batch)), TTFT
and TPOT p50/p99, and the CPU seconds per streamed token of each server process (psutil over
the server's process tree; the client's own, on the same machine, is printed apart and not
counted; it runs on uvloop where installed, ``--client-loop asyncio`` not). The server runs with its defaults but
``--max-num-sequences N`` (the batch a deployment would choose for N streams). Knows nothing
about the server's internals.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import urllib.request
from pathlib import Path

from inflight.bench.client import RequestSpec, run_workload
from inflight.bench.run_context import process_tree
from inflight.bench.stats import summarize
from inflight.bench.systems import RunningServer, SystemSpec

BUSY = "inflight:device_busy_seconds_total"


def _busy_seconds(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:  # noqa: S310 - 127.0.0.1 only
        for line in resp.read().decode().splitlines():
            if line.startswith(BUSY):
                return float(line.rpartition(" ")[2])
    raise RuntimeError(f"{BUSY} not on /metrics: is the server on --device sim?")


def _role(proc, root_pid: int) -> str:  # noqa: ANN001 - a psutil.Process
    if proc.pid == root_pid:
        return "front end"
    cmdline = " ".join(proc.cmdline())
    if "resource_tracker" in cmdline:
        return "resource tracker"
    return "engine core" if "multiprocessing" in cmdline else proc.name()


def _cpu_by_process(server: RunningServer) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process of the server, by role."""
    out: dict[str, float] = {}
    assert server.proc is not None
    for proc in process_tree(server.proc.pid):
        try:
            times = proc.cpu_times()
            role = _role(proc, server.proc.pid)
        except Exception:  # noqa: BLE001 - psutil.Error: it exited meanwhile
            continue
        out[role] = out.get(role, 0.0) + times.user + times.system
    return out


def run_burst(model_dir: Path, num_streams: int, num_tokens: int, step_ms: float, log_dir: Path,
              extra_flags: tuple[str, ...] = (), client_loop: str = "auto") -> dict:
    """One server, one burst: the figures as a dict."""
    profile = log_dir / f"sim-{step_ms:g}ms.json"
    profile.write_text(json.dumps({"base_ms": step_ms, "decode_row_ms": 0, "prefill_token_ms": 0,
                                   "attention_ms_per_1k_context": 0}))
    flags = ("--device", "sim", "--sim-profile", str(profile), "--max-num-sequences", str(num_streams), *extra_flags)
    spec = SystemSpec(f"inflight --device sim ({step_ms:g} ms)", "inflight", flags)
    # ignore_eos: every stream is exactly num_tokens long, as the ideal (full rows every step) assumes;
    # the simulated tokens are hashes, and an EOS among them ended ~7% of the streams early
    specs = [RequestSpec(f"# task {i}\ndef f{i}(x):\n    return", num_tokens, ignore_eos=True)
             for i in range(num_streams)]
    with RunningServer(spec, model_dir, log_dir / f"host_path.{num_streams}x{num_tokens}.{step_ms:g}ms.log") as server:
        cpu_before, busy_before = _cpu_by_process(server), _busy_seconds(server.url)
        client_cpu = time.process_time()
        run = run_workload(server.url, server.model_name, specs, 600.0, client_loop)
        client_cpu = time.process_time() - client_cpu
        busy = _busy_seconds(server.url) - busy_before
        cpu_after = _cpu_by_process(server)
    summary = summarize(run)
    tokens = sum(r.num_output_tokens for r in run.results if r.error is None)
    cpu = {role: cpu_after[role] - cpu_before.get(role, 0.0) for role in cpu_after}
    ideal = num_streams / (step_ms / 1000)
    return {
        "streams": num_streams, "tokens_per_stream": num_tokens, "step_ms": step_ms, "errors": summary.errors,
        "tokens": tokens, "wall_s": run.wall_s, "device_busy": busy / run.wall_s,
        "output_tok_s": summary.output_tok_s, "ideal_tok_s": ideal, "of_ideal": summary.output_tok_s / ideal,
        "ttft_p50_ms": 1e3 * summary.ttft_p50_s, "ttft_p99_ms": 1e3 * summary.ttft_p99_s,
        "tpot_p50_ms": 1e3 * summary.tpot_p50_s, "tpot_p99_ms": 1e3 * summary.tpot_p99_s,
        "cpu_us_per_token": {role: 1e6 * s / max(tokens, 1) for role, s in sorted(cpu.items())},
        "client_cpu_us_per_token": 1e6 * client_cpu / max(tokens, 1), "client_loop": client_loop,
    }


def _line(r: dict) -> str:
    cpu = ", ".join(f"{role} {us:.0f}" for role, us in r["cpu_us_per_token"].items() if us >= 0.5)
    return (f"| {r['streams']} x {r['tokens_per_stream']} | {r['step_ms']:g} | {100 * r['device_busy']:.0f}% | "
            f"{r['output_tok_s']:.0f} / {r['ideal_tok_s']:.0f} ({100 * r['of_ideal']:.0f}%) | "
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
            f"{cpu} | {r['client_cpu_us_per_token']:.0f} | {r['errors']} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.host_path", description=__doc__)
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[10.0])
    parser.add_argument("--size", default="small", help="demo model size (only its config and tokenizer are used)")
    parser.add_argument("--server-flags", default="", help="more flags for inflight serve, in one string "
                        "(the figures are the defaults' without them)")
    parser.add_argument("--client-loop", default="auto", choices=("auto", "uvloop", "asyncio"),
                        help="the bench client's event loop (auto: uvloop where installed)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from inflight.runtime.demo.model import make_demo_model

    work = Path(tempfile.mkdtemp(prefix="host_path-"))
    model_dir = make_demo_model(work / "demo", size=args.size)
    rows = []
    for step_ms in args.step_ms:
        for streams in args.streams:
            started = time.monotonic()
            rows.append(run_burst(model_dir, streams, args.tokens, step_ms, work, tuple(args.server_flags.split()),
                                  args.client_loop))
            logging.info("%d streams at %g ms: done in %.0f s", streams, step_ms, time.monotonic() - started)
    print("\n| burst | step ms | device busy | out tok/s / ideal | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
          "| server CPU us per streamed token | client CPU us per token (not counted) | errors |\n"
          "|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(_line(r))
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
