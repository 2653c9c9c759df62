"""The served burst of ``make gpu-check``: how busy the server keeps the GPU.

Starts ``inflight serve`` on a generated ~0.5B Llama model (no reachable EOS, so every
request generates exactly ``max_tokens``), sends a burst of streaming completions at once,
and samples NVML's GPU utilization (the fraction of time a kernel was running, per ~100 ms
sample) from the first request to the last answer, once synchronously and once with
``--async-scheduling``. Reports output tok/s, TTFT/TPOT and the busy fraction of each. In a dry run (no GPU) a tiny model on the CPU serves a handful of requests and
the busy fraction is ``None``. Knows the server only through its HTTP API.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from inflight.bench.client import RequestSpec, run_workload
from inflight.bench.systems import RunningServer, SystemSpec

BUSY_TARGET = 0.85
SAMPLE_PERIOD_S = 0.05


class BusySampler:
    """Samples NVML GPU utilization on a thread between ``start()`` and ``stop()``."""

    def __init__(self, index: int = 0) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD_S):
            self._samples.append(int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[int]:
        self._stop.set()
        self._thread.join()
        self._nvml.nvmlShutdown()
        return self._samples


def _prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = ("the model serves tokens from a paged cache while requests arrive and leave the "
             "batch at every step of decoding on the device").split()  # fmt: skip
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def run_burst(work_dir: Path, quick: bool = False, dry_run: bool = False, timeout_s: float = 1200.0) -> dict[str, Any]:
    """Serve the burst synchronously, then with ``--async-scheduling``; returns the async run's
    figures (the configuration the busy target is for), the synchronous run's under ``"sync"``,
    and a one-line summary of both. The clients give up ``timeout_s`` after the start (what
    has not answered by then counts as errors), half of what is left for each burst."""
    from inflight.runtime.demo.model import make_demo_model

    deadline = time.monotonic() + timeout_s
    size = "tiny" if dry_run else "0.5b"
    model_dir = make_demo_model(work_dir / f"burst-{size}", "llama", size, eos=False)
    sync = _one_burst(work_dir, Path(model_dir), size, quick, dry_run, (), (deadline - time.monotonic()) / 2)
    report = _one_burst(work_dir, Path(model_dir), size, quick, dry_run, ("--async-scheduling",),
                        deadline - time.monotonic())  # fmt: skip
    report["sync"] = sync
    report["summary"] = f"async scheduling: {report['summary']}; synchronous: {sync['summary']}"
    return report


def _one_burst(work_dir: Path, model_dir: Path, size: str, quick: bool, dry_run: bool,
               extra: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
    num, words, max_tokens = (6, 12, 8) if dry_run else ((256, 100, 64) if quick else (512, 100, 256))
    flags = ("--device", "cpu", "--num-kv-blocks", "256") if dry_run else (
        "--device", "cuda", "--max-num-sequences", "256", "--max-num-tokens", "8192")
    spec = SystemSpec("inflight", "inflight", flags=flags + extra)
    specs = [RequestSpec(p, max_tokens) for p in _prompts(num, words)]
    begun = time.perf_counter()  # the server's start counts against timeout_s too
    with RunningServer(spec, model_dir, work_dir / "burst-server.log") as server:
        sampler = None if dry_run else BusySampler()
        if sampler:
            sampler.start()
        t0 = time.perf_counter()
        run = run_workload(server.url, server.model_name, specs, timeout_s=max(5.0, timeout_s - (t0 - begun)))
        wall = time.perf_counter() - t0
        samples = sampler.stop() if sampler else []
    done = [r for r in run.results if not r.error]
    errors = [r.error for r in run.results if r.error]
    out_tokens = sum(r.num_output_tokens for r in done)
    tpots = [r.tpot_s for r in done if r.tpot_s is not None]
    ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
    busy = statistics.mean(samples) / 100 if samples else None
    report = {
        "model": f"llama ~{size}", "requests": num, "max_tokens": max_tokens, "num_errors": len(errors),
        "errors": errors[:5], "wall_s": wall, "output_tok_per_s": out_tokens / wall if wall else 0.0,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "tpot_p50_s": statistics.median(tpots) if tpots else None,
        "gpu_busy_fraction": busy, "busy_samples": len(samples), "busy_target": BUSY_TARGET,
    }  # fmt: skip
    busy_text = "n/a (no GPU)" if busy is None else f"{100 * busy:.0f}% (target {100 * BUSY_TARGET:.0f}%)"
    report["summary"] = (f"{num} x {max_tokens} tokens, {report['output_tok_per_s']:.0f} out tok/s, "
                         f"GPU busy {busy_text}, {len(errors)} errors")  # fmt: skip
    return report
