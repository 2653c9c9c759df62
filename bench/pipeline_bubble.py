"""The pipeline bubble: each stage's busy fraction with 1, 2 and 4 steps in flight (issue 54).

``python -m bench.pipeline_bubble [--model DIR] [--requests 8] [--max-tokens 24] [--per-step 2] [--rounds 3]``

One PP=2 engine (rank 0 here, the last stage a worker process on 127.0.0.1, gloo) runs the same
requests with the batch queue holding at most 1, 2 and 4 steps
(``BatchQueue.max_in_flight``), the three taking turns for ``--rounds`` rounds; the token budget (``--per-step`` decodes a step) splits the
running requests into micro-batches, so with more than one step in flight the stages work on
different micro-batches at once. Each stage's busy time is the time its rank spends in its
stage's forward (rank 0: :func:`~inflight.runtime.worker.pipeline_step.launch`; the worker:
:func:`~inflight.runtime.worker.pipeline_step.stage_forward` less its wait for the first stage's
activations, timed by this script run as the worker's entry point with ``--as-worker``), over the wall time of the run; the clocks are the
host's monotonic clock, shared by both processes. With one step in flight each stage idles
while the other works (about half each); with two the bubble closes as far as the host work on
rank 0 (scheduling, sampling) and the sends allow. Prints the table and the throughput ratio
against one step in flight. A script, not a test: figures depend on the machine (a shared
2-core machine gives each rank one thread).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEPTHS = (1, 2, 4)


def _timed(fn: Callable[..., Any], spans: list[tuple[float, float]], sink: Path | None = None,
           sign: int = 1) -> Callable[..., Any]:  # fmt: skip
    """``fn`` recording its (start, end) in ``spans`` and as ``sign start end`` lines in ``sink``."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.monotonic()
            spans.append((t0, t1))
            if sink is not None:
                with sink.open("a") as f:
                    f.write(f"{sign} {t0} {t1}\n")
    return wrapper


def as_worker(out_dir: str, argv: list[str]) -> int:
    """A pipeline worker whose stage forwards are timed into ``out_dir/rank<R>.txt``."""
    from inflight.runtime.distributed import worker
    from inflight.runtime.distributed.pipeline import PipelineComm
    from inflight.runtime.worker import model_runner

    sink = Path(out_dir) / f"rank{argv[argv.index('--rank') + 1]}.txt"
    model_runner.stage_forward = _timed(model_runner.stage_forward, [], sink)  # type: ignore[attr-defined]
    # waiting for the previous stage's activations is idle time inside the stage's forward
    PipelineComm.recv_carried = _timed(PipelineComm.recv_carried, [], sink, -1)  # type: ignore[method-assign]
    return worker.main(argv)


def _spawner(out_dir: Path) -> Callable[..., subprocess.Popen[bytes]]:
    def spawn(rank: int, world: int, port: int, model_dir: Any, config: Any, host: str = "127.0.0.1"):
        argv = ["--rank", str(rank), "--world-size", str(world), "--port", str(port), "--master-addr", host,
                "--model-dir", str(model_dir), "--config", json.dumps(config.to_dict()), "--log-level", "WARNING"]
        return subprocess.Popen([sys.executable, "-m", "bench.pipeline_bubble", "--as-worker", str(out_dir), *argv],
                                stdin=subprocess.DEVNULL)
    return spawn


def _busy(spans: list[tuple[float, ...]], start: float, end: float) -> float:
    """Busy share of [start, end]: spans ``(sign, a, b)`` (or ``(a, b)``), a sign of -1 subtracting."""
    total = 0.0
    for span in spans:
        sign, a, b = span if len(span) == 3 else (1.0, *span)
        total += sign * max(0.0, min(b, end) - max(a, start))
    return total / (end - start)


def run(model_dir: Path, requests: int, max_tokens: int, per_step: int, rounds: int) -> list[dict[str, float]]:
    from inflight.runtime.core import engine_batch_queue
    from inflight.runtime.distributed import launcher
    from inflight.runtime.llm import LLM
    from inflight.runtime.sampling_params import SamplingParams

    out_dir = Path(tempfile.mkdtemp(prefix="pipeline-bubble-"))
    launcher._spawn = _spawner(out_dir)  # type: ignore[assignment]
    first: list[tuple[float, float]] = []
    engine_batch_queue.launch = _timed(engine_batch_queue.launch, first)  # type: ignore[assignment]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[1 + (7 * i + j) % 200 for j in range(8)] for i in range(requests)]
    totals = {d: {"wall": 0.0, "busy0": 0.0, "busy1": 0.0, "tokens": 0.0} for d in DEPTHS}
    with LLM(model_dir, pipeline_parallel_size=2, max_num_tokens=per_step, max_num_sequences=requests,
             num_kv_blocks=16 * requests) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up
        for _ in range(rounds):  # the depths take turns, so a change in the machine's load hits all alike
            for depth in DEPTHS:
                llm.engine.pipeline.max_in_flight = depth
                start = time.monotonic()
                outs = llm.generate(prompts, params)
                end = time.monotonic()
                lines = (out_dir / "rank1.txt").read_text().splitlines()
                last = [tuple(map(float, line.split())) for line in lines]
                t = totals[depth]
                t["wall"] += end - start
                t["busy0"] += _busy(first, start, end) * (end - start)
                t["busy1"] += _busy(last, start, end) * (end - start)
                t["tokens"] += sum(len(o.token_ids) for o in outs)
    return [{"in_flight": d, "stage0_busy": t["busy0"] / t["wall"], "stage1_busy": t["busy1"] / t["wall"],
             "tokens_per_s": t["tokens"] / t["wall"]} for d, t in totals.items()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-worker"]:
        return as_worker(argv[1], argv[2:])
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline_bubble")
    parser.add_argument("--model", type=Path, default=None, help="a model directory (default: a small random llama)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--per-step", type=int, default=2, help="decodes a step (the token budget)")
    parser.add_argument("--rounds", type=int, default=3, help="turns each depth takes")
    args = parser.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from inflight.runtime.demo.model import make_demo_model

        model_dir = make_demo_model(Path(tempfile.mkdtemp(prefix="pipeline-bubble-model-")), "llama", "small", 0)
    rows = run(model_dir, args.requests, args.max_tokens, args.per_step, args.rounds)
    base = rows[0]["tokens_per_s"]
    print("steps in flight | stage 0 busy | stage 1 busy | tokens/s vs 1 in flight")
    for row in rows:
        print(f"{row['in_flight']:>15} | {row['stage0_busy']:>12.0%} | {row['stage1_busy']:>12.0%} | "
              f"{row['tokens_per_s'] / base:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
