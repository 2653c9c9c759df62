"""``python -m bench.studies.spec_step_cost``: where a speculating step's time goes on SmolLM2 at
batch 1, beside a plain decode step, in one run.

Two engines on SmolLM2-135M-Instruct (as ``inflight serve`` serves it): no speculation, and
EAGLE-3 with ``-k`` drafts (the head of ``--head``, else a random one of the trained head's shape:
costs do not depend on the weights, only the tokens a step gains does), and n-gram speculation. One request at a time (input-grounded prompts, greedy,
``ignore_eos``), repetitions interleaved; every engine step is timed, and inside it (by wrapping
the live objects' methods, nothing in the engine changed) the target's forward (the plain
decode's one query token, or the verify's ``k + 1``), its LM head, the head's ``fc`` fuse, its
layer passes and its draft-vocabulary logits. What is left of the step is host work (scheduling,
packing, sampling, the rejection sampler, output). Prints a table of ms per step and per output
token. ``--batch 32`` runs that many requests together instead (no step speculates at that size:
what the head costs there is its passes keeping its KV up to date). A benchmark: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams

PARTS = ("target forward", "target lm_head", "head fc", "head layer", "head logits")


class Timer:
    """Seconds spent in each wrapped callable, summed until :meth:`take`."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, obj: object, attr: str, name: str) -> None:
        inner: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - start

        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        out, self.spent = dict(self.spent), defaultdict(float)
        return out


def random_head(model_dir: Path, out: Path, draft_vocab: int) -> Path:
    """A random head of the trained head's shape (:mod:`bench.train_eagle3`'s defaults)."""
    from bench.eagle3_fit import HeadShape, TrainHead, save_head

    cfg = json.loads((model_dir / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    shape = HeadShape(cfg["hidden_size"], heads, cfg["num_key_value_heads"], cfg["hidden_size"] // heads,
                      cfg["intermediate_size"], cfg["vocab_size"], draft_vocab, cfg["rms_norm_eps"],
                      cfg.get("rope_theta", 10000.0))  # fmt: skip
    torch.manual_seed(0)
    ids = torch.sort(torch.randperm(cfg["vocab_size"])[:draft_vocab]).values
    return save_head(TrainHead(shape), out, ids, (2, layers // 2, layers - 3), cfg)


def instrument(engine: LLMEngine, timer: Timer) -> None:
    runner = engine.runner
    timer.wrap(runner.model, "forward", "target forward")
    timer.wrap(runner.model, "compute_logits", "target lm_head")
    proposer = engine.drafter
    if proposer is not None and hasattr(proposer, "head"):  # EAGLE-3's
        timer.wrap(proposer.head, "fuse", "head fc")
        timer.wrap(proposer.head, "forward", "head layer")
        timer.wrap(proposer.head, "logits", "head logits")


def run_one(engine: LLMEngine, timer: Timer, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Totals of the decode steps of ``prompts`` run together (the steps after every request has its
    first token): seconds per part, steps, tokens."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"cost{i}", prompt, params)
    totals: dict[str, float] = defaultdict(float)
    begun: set[str] = set()
    while engine.has_unfinished_requests():
        timer.take()
        start = time.perf_counter()
        outs = engine.step()
        spent = time.perf_counter() - start
        parts = timer.take()
        if len(begun) == len(prompts):
            totals["step"] += spent
            totals["steps"] += 1
            totals["tokens"] += sum(len(o.new_token_ids) for o in outs)
            for name, value in parts.items():
                totals[name] += value
        begun.update(o.req_id for o in outs if o.new_token_ids)
    return totals


def table(results: dict[str, dict[str, float]]) -> str:
    names = list(results)
    lines = ["| ms | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

    def row(label: str, fn: Callable[[dict[str, float]], float]) -> None:
        lines.append(f"| {label} | " + " | ".join(f"{fn(results[n]):.2f}" for n in names) + " |")

    for part in PARTS:
        row(f"{part} / step", lambda r, p=part: 1e3 * r.get(p, 0.0) / r["steps"])
    # the target's forward includes the fuse of its aux states (eagle3 runs it inside the hook)
    row("host and rest / step", lambda r: 1e3 * (r["step"] - sum(r.get(p, 0.0) for p in PARTS[:2])
                                                 - sum(r.get(p, 0.0) for p in PARTS[2:])) / r["steps"])  # fmt: skip
    row("whole step", lambda r: 1e3 * r["step"] / r["steps"])
    row("tokens / step", lambda r: r["tokens"] / r["steps"])
    row("TPOT (ms / token)", lambda r: 1e3 * r["step"] / r["tokens"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.studies.spec_step_cost", description=__doc__)
    p.add_argument("--models-dir", type=Path, default=Path("models"))
    p.add_argument("--head", type=Path, default=None, help="an EAGLE-3 head directory (default: a random one)")
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=1, help="requests run together (>= disable_by_batch_size: none speculates)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from bench.studies.speculative import GROUNDED
    from bench.train_eagle3 import chat_ids
    from inflight.runtime.model.gguf_smollm2 import ensure_smollm2

    model_dir = Path(ensure_smollm2(args.models_dir))
    head = args.head or random_head(model_dir, Path("bench/.work/spec_step_cost_head"), args.draft_vocab)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [chat_ids(tokenizer, text) for text in GROUNDED[:2]]
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": args.k})
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                        "prompt_lookup_min": 2})  # fmt: skip
    configs = {"plain decode": None, f"eagle3 k={args.k}": spec, f"ngram k={args.k}": ngram}
    engines, timers = {}, {}
    for name, cfg in configs.items():
        engines[name] = LLMEngine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=1024, speculative_config=cfg,
                                                                         enable_prefix_caching=False))  # fmt: skip
        engines[name].warmup()
        timers[name] = Timer()
        instrument(engines[name], timers[name])
    results: dict[str, dict[str, float]] = {n: defaultdict(float) for n in configs}
    names = list(configs)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            groups = ([[p] for p in prompts] if args.batch == 1
                      else [[prompts[i % len(prompts)] for i in range(args.batch)]])  # fmt: skip
            for group in groups:
                for key, value in run_one(engines[name], timers[name], group, args.max_tokens).items():
                    results[name][key] += value
    for engine in engines.values():
        engine.close()
    print(f"SmolLM2-135M-Instruct, batch {args.batch}, {len(prompts)} prompts x {args.reps} reps, {args.max_tokens} tokens, "
          f"torch threads {torch.get_num_threads()}; head {head}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
