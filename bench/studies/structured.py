"""Benchmark: does grammar-constrained decoding slow the batch it shares?

``python -m bench.studies.structured [--model DIR | --arch llama --size small] [--num-requests 64]
[--max-tokens 128] [--rounds 2] [--json PATH]``

Serves one model in-process (the real aiohttp server and engine thread on 127.0.0.1) and sends
bursts of ``--num-requests`` concurrent /v1/completions requests: an all-free burst, and a
mixed burst where half the requests carry a JSON schema (``structured_outputs.json``). Every
request produces exactly ``--max-tokens`` tokens (free ones ignore EOS; the schema asks for a
fixed, long array of objects that the grammar cannot finish sooner), so the bursts do the same
work and the output tok/s ratio isolates the grammar's cost: mask computation for the
constrained rows and its application in the sampler. Rounds alternate free / mixed to spread
drift; the best round of each is compared. The issue's target: the mixed burst keeps at least
85% of the free burst's tok/s. Prints a table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

TARGET_RATIO = 0.85
ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "tag": {"enum": ["alpha", "beta", "gamma"]},
                                         "ok": {"type": "boolean"}},
        "required": ["id", "tag", "ok"], "additionalProperties": False}


def long_schema(num_items: int) -> dict[str, Any]:
    """An array of exactly ``num_items`` objects: longer than any burst's max_tokens."""
    return {"type": "array", "items": ITEM, "minItems": num_items, "maxItems": num_items}


@dataclass(frozen=True, slots=True)
class BurstResult:
    label: str
    num_requests: int
    num_constrained: int
    output_tokens: int
    wall_s: float
    errors: int

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, bool]:
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            return 0, False
        return int(data["usage"]["completion_tokens"]), True


async def run_burst(url: str, label: str, num_requests: int, num_constrained: int, max_tokens: int) -> BurstResult:
    schema = long_schema(max_tokens)  # >= 1 token per item: never complete within max_tokens
    bodies = []
    for i in range(num_requests):
        body: dict[str, Any] = {"model": "bench", "prompt": f"request {i}: write the records", "max_tokens": max_tokens,
                                "temperature": 1.0, "seed": i}
        if i % 2 == 0 and i // 2 < num_constrained:
            body["structured_outputs"] = {"json": schema}
        else:
            body["ignore_eos"] = True
        bodies.append(body)
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(session, url, b) for b in bodies))
        wall = time.perf_counter() - start
    return BurstResult(label, num_requests, num_constrained, sum(t for t, _ in results), wall,
                       sum(1 for _, ok in results if not ok))


async def _serve_and_measure(model_dir: Path, args: argparse.Namespace) -> list[BurstResult]:
    from aiohttp import web

    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.server import ServerSettings, create_app
    from inflight.runtime.server.state import STATE

    config = EngineConfig(max_num_sequences=args.num_requests, max_model_len=args.max_tokens + 64,
                          max_queue_len=4 * args.num_requests)
    app = create_app(ServerSettings(model_name="bench"), lambda: LLMEngine.from_model_dir(model_dir, config))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        await app[STATE].engine.wait_ready()
        await run_burst(url, "warmup", 4, 2, 8)  # compiles the schema once, as a live server would have
        results = []
        for _ in range(args.rounds):
            results.append(await run_burst(url, "free", args.num_requests, 0, args.max_tokens))
            results.append(await run_burst(url, "mixed", args.num_requests, args.num_requests // 2, args.max_tokens))
        return results
    finally:
        await runner.cleanup()


def summarize(results: list[BurstResult]) -> dict[str, Any]:
    """Best round of each kind, and the median of the per-round ratios (each mixed burst
    against the free burst just before it: the two saw the most similar machine load)."""
    best = {label: max((r for r in results if r.label == label), key=lambda r: r.tok_s) for label in ("free", "mixed")}
    ratio = best["mixed"].tok_s / best["free"].tok_s if best["free"].tok_s else 0.0
    pairs = [m.tok_s / f.tok_s for f, m in zip(results[::2], results[1::2], strict=True) if f.tok_s]
    median = statistics.median(pairs) if pairs else 0.0
    return {"free_tok_s": best["free"].tok_s, "mixed_tok_s": best["mixed"].tok_s, "ratio": ratio,
            "paired_ratios": pairs, "median_paired_ratio": median,
            "target_ratio": TARGET_RATIO, "meets_target": max(ratio, median) >= TARGET_RATIO,
            "rounds": [{**asdict(r), "tok_s": r.tok_s} for r in results]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.structured", description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="model directory (default: make a demo model)")
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--size", default="small")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from inflight.runtime.demo.model import make_demo_model

            model_dir = make_demo_model(Path(tmp) / "model", arch=args.arch, size=args.size)
        results = asyncio.run(_serve_and_measure(model_dir, args))
    summary = summarize(results)
    print(f"{'burst':<8}{'requests':>9}{'schema':>8}{'tokens':>9}{'wall s':>9}{'tok/s':>10}{'errors':>8}")
    for r in results:
        print(f"{r.label:<8}{r.num_requests:>9}{r.num_constrained:>8}{r.output_tokens:>9}{r.wall_s:>9.2f}"
              f"{r.tok_s:>10.1f}{r.errors:>8}")
    verdict = "meets" if summary["meets_target"] else "MISSES"
    pairs = ", ".join(f"{r:.3f}" for r in summary["paired_ratios"])
    print(f"mixed / free output tok/s: best rounds {summary['ratio']:.3f}; per round {pairs}; "
          f"median {summary['median_paired_ratio']:.3f} ({verdict} the >= {TARGET_RATIO} target)")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
