"""``python -m bench.studies.spec_draft``: draft-model speculative decoding against none, side by side.

Batch-1 greedy TPOT in one process (each engine built once, repetitions interleaved, one
request at a time, the engine stepped directly: no HTTP), with the draft acceptance rate:

* **SmolLM2-135M-Instruct** (served as ``inflight serve`` would: its Q4_1 tensors packed) on
  the input-grounded prompts of :mod:`bench.studies.speculative`: no speculation; the model
  as its own draft (every draft kept: what a draft as costly as the target buys); its first
  ``--truncate-layers`` layers as the draft (a real, much cheaper draft with the same
  tokenizer, untrained for the job); n-gram (k=3) for reference.
* **A synthetic well-matched pair**: a random 18-layer demo model whose layers past the
  second barely change the residual stream, and its first two layers as the draft (~1/6 of
  its weights). Its acceptance is high by construction, its costs are real: what a draft
  that agrees often and is much smaller buys on this CPU.

Writes ``spec_draft.md`` / ``.json`` under the results directory. A benchmark: it asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from bench.studies.speculative import GROUNDED
from inflight.bench import report
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.model.gguf_smollm2 import ensure_smollm2
from inflight.runtime.sampling_params import SamplingParams

logger = logging.getLogger("bench.studies.spec_draft")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


@dataclass(frozen=True, slots=True)
class System:
    name: str
    model_dir: Path
    speculative_config: str | None


def _draft(model_dir: Path, k: int) -> str:
    return json.dumps({"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k})


def _ngram(k: int) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2})


def truncated_copy(model_dir: Path, out: Path, num_layers: int) -> Path:
    """``model_dir`` cut to its first ``num_layers`` layers (float safetensors, same tokenizer)."""
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    index_path = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index_path.read_text())["weight_map"].values())) if index_path.is_file()
             else ["model.safetensors"])  # fmt: skip
    tensors = {}
    for name in files:
        with safe_open(str(model_dir / name), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if not key.startswith("model.layers.") or int(key.split(".")[2]) < num_layers:
                    tensors[key] = handle.get_tensor(key)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


def matched_pair(work: Path, draft_layers: int = 2, damping: float = 0.02) -> tuple[Path, Path]:
    """A medium demo model whose layers from ``draft_layers`` on write ``damping`` x their
    output into the residual stream, and its first ``draft_layers`` layers as a draft."""
    target = work / "matched-target"
    if not (target / "config.json").is_file():
        make_demo_model(target, "llama", "medium", seed=0, eos=False)
        weights = load_file(target / "model.safetensors")
        for key, value in weights.items():
            if key.endswith(("o_proj.weight", "down_proj.weight")) and int(key.split(".")[2]) >= draft_layers:
                weights[key] = value * damping
        save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target, truncated_copy(target, work / "matched-draft", draft_layers)


def _tpot_ms(engine: LLMEngine, prompt_ids: list[int], max_tokens: int) -> float:
    """Mean time per output token after the first, for one request alone in the engine."""
    engine.add_request("bench", prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    first: float | None = None
    count = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            count += len(out.new_token_ids)
            if first is None and out.new_token_ids:
                first = time.perf_counter()
    assert first is not None and count > 1
    return 1e3 * (time.perf_counter() - first) / (count - 1)


def measure(systems: list[System], prompts: dict[Path, list[list[int]]], reps: int, max_tokens: int) -> dict[str, Any]:
    """Median batch-1 TPOT and the acceptance of each system, repetitions interleaved."""
    engines = {}
    for s in systems:
        engines[s.name] = LLMEngine.from_model_dir(s.model_dir, EngineConfig(num_kv_blocks=512,
                                                   speculative_config=s.speculative_config))  # fmt: skip
        engines[s.name].warmup()
    tpots: dict[str, list[float]] = {s.name: [] for s in systems}
    for rep in range(reps):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for s in order:
            for prompt in prompts[s.model_dir]:
                tpots[s.name].append(_tpot_ms(engines[s.name], prompt, max_tokens))
        logger.info("rep %d: %s", rep, {n: round(statistics.median(v), 1) for n, v in tpots.items()})
    out = {}
    for s in systems:
        stats = engines[s.name].stats()
        drafted = stats.spec_num_draft_tokens
        out[s.name] = {"tpot_p50_ms": statistics.median(tpots[s.name]), "tpots_ms": tpots[s.name],
                       "acceptance": stats.spec_num_accepted_tokens / drafted if drafted else None,
                       "accepted_per_position": list(stats.spec_accepted_per_position)}  # fmt: skip
        engines[s.name].close()
    return out


def _table(results: dict[str, Any], base: str) -> str:
    rows = []
    for name, r in results.items():
        acceptance = "" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        rows.append([name, f"{r['tpot_p50_ms']:.1f}", acceptance, f"{results[base]['tpot_p50_ms'] / r['tpot_p50_ms']:.2f}x"])
    return report.simple_table(["system", "batch-1 TPOT p50 ms", "draft acceptance", "speed vs none"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.spec_draft", description=__doc__)
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--work-dir", type=Path, default=Path("bench/.work/spec_draft"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--truncate-layers", type=int, default=4)
    parser.add_argument("-k", type=int, default=3, help="num_speculative_tokens of the draft models")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    smol = Path(ensure_smollm2(args.models_dir))
    short = truncated_copy(smol, args.work_dir / f"smollm2-{args.truncate_layers}-layers", args.truncate_layers)
    target, draft = matched_pair(args.work_dir)
    smol_systems = [System("SmolLM2: no speculation", smol, None),
                    System(f"SmolLM2: itself as draft (k={args.k})", smol, _draft(smol, args.k)),
                    System(f"SmolLM2: its first {args.truncate_layers} layers as draft (k={args.k})", smol,
                           _draft(short, args.k)),
                    System("SmolLM2: n-gram (k=3)", smol, _ngram(3))]  # fmt: skip
    pair_systems = [System("matched pair: no speculation", target, None),
                    System(f"matched pair: 2-layer draft (k={args.k})", target, _draft(draft, args.k))]  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smol))
    chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                            add_generation_prompt=True), add_special_tokens=False)
             for t in GROUNDED]  # fmt: skip
    demo_tok = AutoTokenizer.from_pretrained(str(target))
    demo = [demo_tok.encode(t) for t in GROUNDED]
    torch.manual_seed(0)
    smol_res = measure(smol_systems, {smol: chats}, args.reps, args.max_tokens)
    pair_res = measure(pair_systems, {target: demo}, args.reps, args.max_tokens)
    text = (f"# Speculative decoding with a draft model (batch 1, this CPU)\n\n"
            f"Engine stepped in process, greedy, {args.max_tokens} output tokens per request, one request at a "
            f"time, {args.reps} interleaved repetitions of {len(GROUNDED)} input-grounded prompts (medians).\n\n"
            f"{_table(smol_res, smol_systems[0].name)}\n\n{_table(pair_res, pair_systems[0].name)}\n")
    print("\n" + text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "spec_draft.md").write_text(text)
    report.write_json(args.results_dir / "spec_draft.json", {"smollm2": smol_res, "matched_pair": pair_res,
                                                             "reps": args.reps, "max_tokens": args.max_tokens})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
