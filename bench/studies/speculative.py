"""``python -m bench.studies.speculative``: n-gram speculative decoding on SmolLM2, served.

Serves SmolLM2-135M-Instruct with and without ``--speculative-config`` (n-gram, 4 tokens),
repetitions interleaved, and measures: TPOT p50 at batch 1 (one request at a time) on an
input-grounded workload (copy, reformat or continue code that is in the prompt, chat
template applied, greedy), with the draft acceptance rate read from ``/metrics``; and the
output tok/s of a 64-request burst of ordinary chat questions (where speculation should
switch itself off by batch size). Writes ``speculative.md`` / ``.json`` under the results
directory. A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import urllib.request
from pathlib import Path
from typing import Any

from inflight.bench import report
from inflight.bench.client import RequestSpec, run_workload
from inflight.bench.smollm2 import QUESTIONS
from inflight.bench.stats import summarize
from inflight.bench.systems import RunningServer, SystemSpec
from inflight.runtime.model.gguf_smollm2 import ensure_smollm2

logger = logging.getLogger("bench.studies.speculative")


def _spec(k: int) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2})


# k=3: 4 rows a step, one pass of the native few-row linear (it dots up to 4 rows at a time);
# k=4 is vLLM's documented example and needs a second pass.
SYSTEMS = (SystemSpec("no speculation", "inflight", ("--num-kv-blocks", "1024")),
           SystemSpec("n-gram speculation (k=3)", "inflight", ("--num-kv-blocks", "1024", "--speculative-config", _spec(3))),
           SystemSpec("n-gram speculation (k=4)", "inflight", ("--num-kv-blocks", "1024", "--speculative-config", _spec(4))))  # fmt: skip

CODE = '''def parse_config(path):
    """Read a key=value config file into a dict, skipping comments and blank lines."""
    result = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            result[key.strip()] = value.strip()
    return result
'''
GROUNDED = (
    f"Copy this Python function exactly, without any change:\n\n{CODE}",
    f"Rewrite this function with the variable `handle` renamed to `f`. Keep everything else the same:\n\n{CODE}",
    f"Add a docstring line at the end of the docstring of this function and repeat the whole function:\n\n{CODE}",
    f"Here is a function. Repeat it, then explain it in one sentence:\n\n{CODE}",
)


def _chat_prompt(tokenizer: Any, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:  # noqa: S310 - 127.0.0.1 only
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _batch1(server: RunningServer, prompts: list[str], max_tokens: int) -> dict[str, float]:
    drafts0 = _counter(server.url, "inflight:spec_decode_num_draft_tokens_total")
    accepted0 = _counter(server.url, "inflight:spec_decode_num_accepted_tokens_total")
    tpots = []
    for prompt in prompts:  # one at a time: batch 1
        result = run_workload(server.url, server.model_name, [RequestSpec(prompt, max_tokens)]).results[0]
        if result.tpot_s is not None:
            tpots.append(result.tpot_s)
    drafts = _counter(server.url, "inflight:spec_decode_num_draft_tokens_total") - drafts0
    accepted = _counter(server.url, "inflight:spec_decode_num_accepted_tokens_total") - accepted0
    return {"tpot_p50_ms": 1e3 * statistics.median(tpots), "acceptance": accepted / drafts if drafts else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.speculative", description=__doc__)
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--burst-requests", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model_dir = Path(ensure_smollm2(args.models_dir))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    grounded = [_chat_prompt(tokenizer, text) for text in GROUNDED]
    burst = [RequestSpec(_chat_prompt(tokenizer, QUESTIONS[i % len(QUESTIONS)]), 64) for i in range(args.burst_requests)]
    runs: dict[str, dict[str, list[float]]] = {s.name: {} for s in SYSTEMS}
    log_dir = Path("bench/.work/speculative_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    for rep in range(args.reps):
        shift = rep % len(SYSTEMS)
        order = SYSTEMS[shift:] + SYSTEMS[:shift]
        for spec in order:
            with RunningServer(spec, model_dir, log_dir / f"{spec.name[:12].replace(' ', '_')}.rep{rep}.log") as server:
                figures = _batch1(server, grounded, args.max_tokens)
                figures["burst_out_tok_s"] = summarize(run_workload(server.url, server.model_name, burst)).output_tok_s
            for key, value in figures.items():
                runs[spec.name].setdefault(key, []).append(value)
            logger.info("%s rep %d: %s", spec.name, rep, figures)
    med = {name: {k: statistics.median(v) for k, v in figs.items()} for name, figs in runs.items()}
    base = SYSTEMS[0].name
    spec_name = min((s.name for s in SYSTEMS[1:]), key=lambda n: med[n]["tpot_p50_ms"])  # the better k
    rows = [[name, f"{m['tpot_p50_ms']:.2f}", "" if name == base else f"{100 * m['acceptance']:.0f}%",
             f"{m['burst_out_tok_s']:.0f}"] for name, m in med.items()]  # fmt: skip
    table = report.simple_table(["system", "batch-1 TPOT p50 ms (grounded)", "draft acceptance",
                                 f"{args.burst_requests}-request burst out tok/s"], rows)  # fmt: skip
    speedup = med[base]["tpot_p50_ms"] / med[spec_name]["tpot_p50_ms"]
    burst_ratio = med[spec_name]["burst_out_tok_s"] / med[base]["burst_out_tok_s"]
    text = (f"# Speculative decoding (n-gram) on SmolLM2-135M-Instruct\n\nServed on this CPU, {args.reps} interleaved "
            f"repetitions (medians), greedy, {args.max_tokens} output tokens per grounded request.\n\n{table}\n\n"
            f"Batch-1 TPOT with {spec_name}: {speedup:.2f}x faster than without (target >= 1.5x). Burst: "
            f"{burst_ratio:.3f}x the output tok/s without (target >= 0.97x).\n")  # fmt: skip
    print("\n" + text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "speculative.md").write_text(text)
    report.write_json(args.results_dir / "speculative.json", {"runs": runs, "medians": med,
                                                                "tpot_speedup": speedup, "burst_ratio": burst_ratio})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
