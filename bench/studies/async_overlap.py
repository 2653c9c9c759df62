"""Async scheduling A/B: the same engine and burst with the host's work overlapped or not.

``python -m bench.studies.async_overlap [--sizes small medium] [--reps 2]`` makes the bench
models locally, then for each size runs a burst of greedy requests through one synchronous and
one async-scheduling engine (``EngineConfig.async_scheduling``), in interleaved repetitions, and
prints output tokens per second, the ratio and a check that both produced the same tokens. On
a GPU it is what shows the host's share of a step being hidden; on the CPU the "device" is the
same cores the host runs on, so it shows what the overlap costs or gains there.
Knows nothing about HTTP.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.sampling_params import SamplingParams

WORK = Path("bench/.work/async-overlap")


def _burst(engine: LLMEngine, num_requests: int, max_tokens: int) -> tuple[float, dict[str, list[int]]]:
    """Output tokens per second of one burst, and every request's tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"r{i}", engine.encode_prompt(f"request {i}: def f(x):"), params)
    tokens: dict[str, list[int]] = {}
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    elapsed = time.perf_counter() - started
    return sum(map(len, tokens.values())) / elapsed, tokens


def run(sizes: list[str], reps: int, num_requests: int, max_tokens: int, device: str) -> list[str]:
    lines = [f"async scheduling A/B: {num_requests} greedy requests x {max_tokens} tokens, {reps} interleaved "
             f"reps, device {device}", "",
             "| model | sync out tok/s | async out tok/s | async / sync | same tokens |", "|---|---|---|---|---|"]
    for size in sizes:
        model_dir = WORK / f"llama-{size}"
        if not (model_dir / "config.json").exists():
            make_demo_model(model_dir, "llama", size)
        engines = {flag: LLMEngine.from_model_dir(model_dir, EngineConfig(
            device=device, max_num_sequences=num_requests, async_scheduling=flag, max_model_len=512))
            for flag in (False, True)}  # fmt: skip
        rates: dict[bool, list[float]] = {False: [], True: []}
        same = True
        for rep in range(reps):
            order = (False, True) if rep % 2 == 0 else (True, False)
            outputs = {}
            for flag in order:
                engines[flag].warmup()
                rate, outputs[flag] = _burst(engines[flag], num_requests, max_tokens)
                rates[flag].append(rate)
            same = same and outputs[False] == outputs[True]
        for engine in engines.values():
            engine.close()
        sync, overlapped = statistics.median(rates[False]), statistics.median(rates[True])
        lines.append(f"| {size} | {sync:.0f} | {overlapped:.0f} | {overlapped / sync:.3f}x | "
                     f"{'yes' if same else 'NO'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "medium"])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    print("\n".join(run(args.sizes, args.reps, args.requests, args.max_tokens, args.device)))


if __name__ == "__main__":
    main()
