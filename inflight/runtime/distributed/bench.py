"""Per-step overhead of tensor parallelism: decode-step time at TP=N against TP=1.

``python -m inflight.runtime.distributed.bench --model DIR [--tp 2] [--batch 1 64] [--steps 30]``

For each batch size it fills one engine with that many decoding sequences (short prompts,
outputs that never stop early), then times ``--steps`` decode steps and reports the median
and the interquartile range, for TP=1 and TP=N one after the other in this process (the
TP=N engine starts its workers, the TP=1 one runs alone). Prints a table and, with
``--json``, writes the figures. A script, not a test: timing depends on the machine (on a
shared 2-core machine each rank gets one thread).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams


def _fill(engine: LLMEngine, batch: int, steps: int) -> None:
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench-{i}", [1 + (7 * i + j) % 200 for j in range(8)], params)
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
        engine.step()


def time_decode_steps(engine: LLMEngine, batch: int, steps: int) -> dict[str, float]:
    """Median and quartiles (ms) of ``steps`` decode steps with ``batch`` sequences running."""
    _fill(engine, batch, steps)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for req_id in [f"bench-{i}" for i in range(batch)]:
        engine.abort_request(req_id)
    q = statistics.quantiles(times, n=4)
    return {"median_ms": 1e3 * statistics.median(times), "p25_ms": 1e3 * q[0], "p75_ms": 1e3 * q[2]}


def run(model_dir: Path, tp: int, batches: list[int], steps: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for size in (1, tp):
        config = EngineConfig(tensor_parallel_size=size, max_num_sequences=max(batches), max_model_len=512,
                              num_kv_blocks=max(batches) * 512 // 16)
        engine = LLMEngine.from_model_dir(model_dir, config)
        try:
            engine.warmup()
            for batch in batches:
                rows.append({"tp": size, "batch": batch, **time_decode_steps(engine, batch, steps)})
        finally:
            engine.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inflight.runtime.distributed.bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a local model directory (e.g. a demo model)")
    parser.add_argument("--tp", type=int, default=2, help="the tensor-parallel size to compare with 1")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    rows = run(Path(args.model), args.tp, args.batch, args.steps)
    print(f"{'TP':>3} {'batch':>6} {'step ms (median)':>17} {'IQR':>15}")
    for r in rows:
        print(f"{r['tp']:>3} {r['batch']:>6} {r['median_ms']:>17.2f} {r['p25_ms']:>7.2f}-{r['p75_ms']:<7.2f}")
    for batch in args.batch:
        one = next(r for r in rows if r["tp"] == 1 and r["batch"] == batch)
        many = next(r for r in rows if r["tp"] == args.tp and r["batch"] == batch)
        print(f"batch {batch}: TP={args.tp} minus TP=1 = {many['median_ms'] - one['median_ms']:+.2f} ms per step "
              f"({many['median_ms'] / one['median_ms']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
