"""``python -m bench.studies.spec_pipeline``: speculating steps pipelined under async scheduling, A/B.

One process, the engine stepped directly (no HTTP), greedy requests of the input-grounded prompts
of :mod:`bench.studies.speculative` on the matched pair of :mod:`bench.studies.spec_draft` (a
demo model whose late layers barely move the residual stream, its first two layers as the draft:
high acceptance, real costs; ``--method ngram``: the same target with n-gram drafts). Three
engines with the same speculation:

* **sync**: the synchronous step;
* **async, drained**: ``--async-scheduling`` with every speculating step waiting for the step in
  flight (what the engine did before ``core/spec_pipeline.py``; switched off per engine here);
* **async, pipelined**: speculating steps scheduled while the step before runs, fixed up on the
  worker from its accepted counts (the default now).

For each concurrency (``--batches``), each engine runs the same burst in interleaved repetitions:
output tokens per second, the median time per output token after each request's first, how many
steps drained the pipeline (ran synchronously, or waited for the step in flight) against how many
speculating steps were pipelined, and a check that every engine produced the same tokens. On
this CPU the "device" is the host's own cores, so the figures say what the overlap gains or
costs here, not what a GPU gains. Writes ``spec_pipeline.md`` / ``.json`` under the results
directory. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from bench.studies.spec_draft import matched_pair
from bench.studies.speculative import GROUNDED, _chat_prompt
from inflight.bench import report
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.async_steps import StepPipeline
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.model.gguf_smollm2 import ensure_smollm2
from inflight.runtime.sampling_params import SamplingParams

logger = logging.getLogger("bench.studies.spec_pipeline")
SYSTEMS = ("sync", "async, drained", "async, pipelined")


def _engine(system: str, target: Path, draft: Path | None, k: int, batch: int) -> LLMEngine:
    """``draft`` None: n-gram drafts (prompt lookup of 1-4 tokens)."""
    method = {"method": "draft_model", "model": str(draft)} if draft is not None else {
        "method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 4}  # fmt: skip
    spec = json.dumps({**method, "num_speculative_tokens": k, "disable_by_batch_size": max(8, batch + 1)})
    engine = LLMEngine.from_model_dir(target, EngineConfig(num_kv_blocks=1024, speculative_config=spec,
                                                           async_scheduling=system != "sync"))  # fmt: skip
    if system == "async, drained":
        assert isinstance(engine.pipeline, StepPipeline)
        engine.pipeline.pipelines_speculation = False  # read as each request is added
    engine.warmup()
    return engine


def _burst(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, dict[str, list[int]]]:
    """(output tok/s, median ms per output token after each request's first, every request's tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                now = time.perf_counter()
                first.setdefault(out.req_id, now)
                last[out.req_id] = now
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    elapsed = time.perf_counter() - started
    tpots = [1e3 * (last[r] - first[r]) / (len(t) - 1) for r, t in tokens.items() if len(t) > 1]
    return sum(map(len, tokens.values())) / elapsed, statistics.median(tpots), tokens


def measure(target: Path, draft: Path | None, prompts: list[list[int]], batches: list[int], reps: int, k: int,
            max_tokens: int) -> dict[str, Any]:  # fmt: skip
    results: dict[str, Any] = {}
    for batch in batches:
        burst = [prompts[i % len(prompts)] for i in range(batch)]
        engines = {s: _engine(s, target, draft, k, batch) for s in SYSTEMS}
        rates: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        tpots: dict[str, list[float]] = {s: [] for s in SYSTEMS}
        same = True
        for rep in range(reps):
            order = SYSTEMS[rep % 3 :] + SYSTEMS[: rep % 3]
            outputs = {}
            for s in order:
                rate, tpot, outputs[s] = _burst(engines[s], burst, max_tokens)
                rates[s].append(rate)
                tpots[s].append(tpot)
            same = same and outputs["sync"] == outputs["async, drained"] == outputs["async, pipelined"]
            logger.info("batch %d rep %d: %s", batch, rep, {s: round(rates[s][-1]) for s in SYSTEMS})
        row: dict[str, Any] = {"same_tokens": same}
        for s, engine in engines.items():
            stats = engine.stats()
            pipeline = engine.pipeline
            row[s] = {"tok_s": rates[s], "tpot_ms": tpots[s], "acceptance": stats.spec_num_accepted_tokens
                      / max(1, stats.spec_num_draft_tokens),
                      "drained": pipeline.num_drains + pipeline.num_spec_waits if isinstance(pipeline, StepPipeline)
                      else None,
                      "spec_pipelined": pipeline.num_spec_pipelined if isinstance(pipeline, StepPipeline) else None}  # fmt: skip
            engine.close()
        results[str(batch)] = row
    return results


def table(results: dict[str, Any]) -> str:
    rows = []
    for batch, row in results.items():
        sync = statistics.median(row["sync"]["tok_s"])
        for s in SYSTEMS:
            r = row[s]
            rate = statistics.median(r["tok_s"])
            waits = "" if r["drained"] is None else f"{r['drained']} / {r['spec_pipelined']}"
            rows.append([batch, s, ", ".join(f"{v:.0f}" for v in r["tok_s"]), f"{rate / sync:.3f}x",
                         f"{statistics.median(r['tpot_ms']):.2f}", f"{100 * r['acceptance']:.0f}%", waits,
                         "yes" if row["same_tokens"] else "NO"])  # fmt: skip
    return report.simple_table(["requests", "system", "out tok/s per rep", "median vs sync", "TPOT p50 ms",
                                "acceptance", "steps drained / pipelined", "same tokens"], rows)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.spec_pipeline", description=__doc__)
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--work-dir", type=Path, default=Path("bench/.work/spec_draft"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--method", choices=["draft_model", "ngram"], default="draft_model")
    parser.add_argument("--smollm2", action="store_true",
                        help="n-gram drafts on SmolLM2-135M-Instruct (chat prompts of the grounded texts)")
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from transformers import AutoTokenizer

    target, draft = matched_pair(args.work_dir)
    ngram = args.method == "ngram" or args.smollm2
    if args.smollm2:
        target = Path(ensure_smollm2(args.models_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    prompts = ([tokenizer.encode(_chat_prompt(tokenizer, t), add_special_tokens=False) for t in GROUNDED]
               if args.smollm2 else [tokenizer.encode(t) for t in GROUNDED])  # fmt: skip
    results = measure(target, None if ngram else draft, prompts, args.batches, args.reps, args.k, args.max_tokens)
    name = "spec_pipeline_smollm2" if args.smollm2 else "spec_pipeline_ngram" if ngram else "spec_pipeline"
    drafter = f"n-gram drafts (k={args.k})" if ngram else f"2-layer draft, k={args.k}"
    model = "SmolLM2-135M-Instruct, chat prompts" if args.smollm2 else "Matched pair's target"
    text = (f"# Speculating steps under async scheduling: drained against pipelined (this CPU)\n\n"
            f"{model} ({drafter}), greedy, {args.max_tokens} output tokens per request, "
            f"engine stepped in process, {args.reps} interleaved repetitions.\n\n{table(results)}\n")
    print("\n" + text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"{name}.md").write_text(text)
    report.write_json(args.results_dir / f"{name}.json", {"results": results, "reps": args.reps, "k": args.k,
                                                          "method": args.method, "max_tokens": args.max_tokens})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
