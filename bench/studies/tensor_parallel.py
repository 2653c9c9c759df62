"""Per-step overhead of tensor parallelism: decode-step time at TP=N against TP=1.

``python -m bench.studies.tensor_parallel --model DIR [--tp 2] [--batch 1 64] [--steps 30]``

For each batch size it fills one engine with that many decoding sequences (short prompts,
outputs that never stop early), then times ``--steps`` decode steps and reports the median
and the interquartile range, for a TP=1 and a TP=N engine living side by side in this
process (the TP=N one with its workers), taking turns in rounds so that a change in a shared
machine's load hits both alike. Prints a table and, with
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
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams


def _fill(engine: LLMEngine, batch: int, steps: int) -> None:
    params = SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench-{i}", [1 + (7 * i + j) % 200 for j in range(8)], params)
    while engine.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
        engine.step()


def _summary(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=4)
    return {"median_ms": 1e3 * statistics.median(times), "p25_ms": 1e3 * q[0], "p75_ms": 1e3 * q[2]}


def time_decode_steps(engines: dict[int, LLMEngine], batch: int, steps: int, rounds: int = 10) -> list[dict[str, Any]]:
    """Decode-step times with ``batch`` sequences running, the engines taking turns.

    Rounds of ``steps / rounds`` steps alternate between the engines, so a change in the
    machine's load (a shared machine) hits both alike.
    """
    for engine in engines.values():
        _fill(engine, batch, steps)
    times: dict[int, list[float]] = {tp: [] for tp in engines}
    for _ in range(rounds):
        for tp, engine in engines.items():
            for _ in range(max(1, steps // rounds)):
                t0 = time.perf_counter()
                engine.step()
                times[tp].append(time.perf_counter() - t0)
    for engine in engines.values():
        for i in range(batch):
            engine.abort_request(f"bench-{i}")
    return [{"tp": tp, "batch": batch, **_summary(t)} for tp, t in times.items()]


def run(model_dir: Path, tp: int, batches: list[int], steps: int) -> list[dict[str, Any]]:
    """Both engines live at once (only TP=N uses torch.distributed); see module docstring."""
    engines: dict[int, LLMEngine] = {}
    try:
        for size in (1, tp):
            config = EngineConfig(tensor_parallel_size=size, max_num_sequences=max(batches), max_model_len=512,
                                  num_kv_blocks=max(batches) * 512 // 16)
            engines[size] = LLMEngine.from_model_dir(model_dir, config)
            engines[size].warmup()
        return [row for batch in batches for row in time_decode_steps(engines, batch, steps)]
    finally:
        for engine in engines.values():
            engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.tensor_parallel",
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
