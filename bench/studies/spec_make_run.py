"""``python -m bench.studies.spec_make_run``: what ``make run SPEC=1`` buys on SmolLM2, served, in one
interleaved run.

Serves SmolLM2-135M-Instruct (Q4_1 GGUF, as ``make run`` does) without speculation and with the
speculative config of ``make run SPEC=1`` (read from the Makefile's ``SPEC_CONFIG`` line, so this
measures exactly what the target serves), plus any ``--candidates`` (the same n-gram config with
other ``num_speculative_tokens``, to choose k). Repetitions interleave the systems, each rotation
starting at another one. Per system and repetition:

* batch 1: input-grounded prompts (summarise, repeat, rewrite a given passage of this repository's
  docs, from :func:`bench.eagle3_data.held_out_prompts`, and the code-copy prompts of
  :mod:`bench.studies.speculative`; chat template applied, greedy) one at a time: TPOT p50, and
  the draft acceptance from ``/metrics`` (overall and per draft position);
* batch 32: 32 ordinary chat questions at once (64 tokens each): output tok/s. At this size no
  step speculates (``disable_by_batch_size``); only the ramp-down tail does.

Ratios are taken within a repetition (a paired run) and their median is quoted beside the ratio
of medians. Writes ``spec_make_run.md`` / ``.json`` under ``--results-dir``. A benchmark: it
asserts nothing; the numbers belong to the machine they were taken on.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import statistics
import urllib.request
from pathlib import Path
from typing import Any

from bench.eagle3_data import held_out_prompts
from bench.studies.speculative import GROUNDED
from inflight.bench import report
from inflight.bench.client import RequestSpec, run_workload
from inflight.bench.smollm2 import QUESTIONS
from inflight.bench.stats import summarize
from inflight.bench.systems import RunningServer, SystemSpec
from inflight.runtime.model.gguf_smollm2 import ensure_smollm2
from inflight.runtime.spec_decode.speculative import parse_speculative_config

logger = logging.getLogger("bench.studies.spec_make_run")
BASE = "no speculation"
MAKE_RUN = "make run SPEC=1"


def makefile_spec_config(makefile: Path = Path("Makefile")) -> str:
    """The JSON of the Makefile's ``SPEC_CONFIG := ...`` line (what ``make run SPEC=1`` serves)."""
    match = re.search(r"^SPEC_CONFIG\s*:=\s*(\{.*\})\s*$", makefile.read_text(), re.MULTILINE)
    if match is None:
        raise ValueError(f"{makefile} has no 'SPEC_CONFIG := {{...}}' line")
    return match.group(1)


def _systems(config: str, candidates: list[int], run_args: tuple[str, ...]) -> list[SystemSpec]:
    systems = [SystemSpec(BASE, "inflight", run_args),
               SystemSpec(MAKE_RUN, "inflight", (*run_args, "--speculative-config", config))]
    raw = json.loads(config)
    for k in candidates:
        if k != raw.get("num_speculative_tokens"):
            other = json.dumps({**raw, "num_speculative_tokens": k})
            systems.append(SystemSpec(f"ngram k={k}", "inflight", (*run_args, "--speculative-config", other)))
    return systems


def _metrics(url: str) -> dict[str, float]:
    """The spec-decode counters of ``/metrics``, by name (per-position ones with their label)."""
    out: dict[str, float] = {}
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:  # noqa: S310 - 127.0.0.1 only
        for line in resp.read().decode().splitlines():
            if line.startswith("inflight:spec_decode_num_"):
                name, value = line.rsplit(" ", 1)
                position = re.search(r'position="(\d+)"', name)
                key = name.split("{", 1)[0] + (f"@{position.group(1)}" if position else "")
                out[key] = out.get(key, 0.0) + float(value)
    return out


def _batch1(server: RunningServer, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    before = _metrics(server.url)
    tpots = []
    for prompt in prompts:  # one at a time: batch 1
        result = run_workload(server.url, server.model_name, [RequestSpec(prompt, max_tokens)]).results[0]
        if result.tpot_s is not None:
            tpots.append(result.tpot_s)
    after = _metrics(server.url)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    drafts = delta.get("inflight:spec_decode_num_draft_tokens_total", 0.0)
    num_drafts = delta.get("inflight:spec_decode_num_drafts_total", 0.0)
    per_position = [delta[key] / num_drafts for key in sorted(
        (k for k in delta if k.startswith("inflight:spec_decode_num_accepted_tokens_per_pos")),
        key=lambda k: int(k.rsplit("@", 1)[1]))] if num_drafts else []
    accepted = delta.get("inflight:spec_decode_num_accepted_tokens_total", 0.0)
    return {"tpot_p50_ms": 1e3 * statistics.median(tpots), "acceptance": accepted / drafts if drafts else None,
            "per_position": per_position}


def _row(name: str, med: dict[str, Any], paired: dict[str, float]) -> list[str]:
    acc = med["acceptance"]
    return [name, f"{med['tpot_p50_ms']:.1f}", f"{paired['tpot']:.2f}x", f"{med['batch32_tok_s']:.0f}",
            f"{paired['batch32']:.2f}x", "" if acc is None else f"{100 * acc:.0f}%",
            " / ".join(f"{100 * p:.0f}%" for p in med["per_position"])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.spec_make_run", description=__doc__)
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96, help="output tokens per batch-1 request")
    parser.add_argument("--held-out", type=int, default=6, help="docs/ passages among the batch-1 prompts")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--candidates", type=int, nargs="*", default=[], help="other k to measure beside SPEC=1's")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.batch < 1:
        raise ValueError("--reps and --batch must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = makefile_spec_config()
    parse_speculative_config(config)  # a bad Makefile line fails here, not in a server's log
    model_dir = Path(ensure_smollm2(args.models_dir))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def chat(text: str) -> str:
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)

    grounded = [chat(t) for t in [*held_out_prompts(Path("docs"), args.held_out, seed=0), *GROUNDED]]
    batch = [RequestSpec(chat(QUESTIONS[i % len(QUESTIONS)]), 64) for i in range(args.batch)]
    systems = _systems(config, args.candidates, ("--num-kv-blocks", "1024"))
    runs: dict[str, list[dict[str, Any]]] = {s.name: [] for s in systems}
    log_dir = Path("bench/.work/spec_make_run_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    for rep in range(args.reps):
        order = systems[rep % len(systems):] + systems[:rep % len(systems)]
        for spec in order:
            log = log_dir / f"{re.sub(r'[^a-z0-9]+', '_', spec.name.lower())}.rep{rep}.log"
            with RunningServer(spec, model_dir, log) as server:
                figures = _batch1(server, grounded, args.max_tokens)
                figures["batch32_tok_s"] = summarize(run_workload(server.url, server.model_name, batch)).output_tok_s
            runs[spec.name].append(figures)
            logger.info("%s rep %d: %s", spec.name, rep, figures)
    med: dict[str, dict[str, Any]] = {}
    paired: dict[str, dict[str, float]] = {}
    for name, figs in runs.items():
        accs = [f["acceptance"] for f in figs if f["acceptance"] is not None]
        positions = [f["per_position"] for f in figs if f["per_position"]]
        med[name] = {"tpot_p50_ms": statistics.median(f["tpot_p50_ms"] for f in figs),
                     "batch32_tok_s": statistics.median(f["batch32_tok_s"] for f in figs),
                     "acceptance": statistics.median(accs) if accs else None,
                     "per_position": [statistics.median(p) for p in zip(*positions, strict=False)] if positions else []}
        paired[name] = {
            "tpot": statistics.median(b["tpot_p50_ms"] / f["tpot_p50_ms"] for b, f in zip(runs[BASE], figs, strict=True)),
            "batch32": statistics.median(f["batch32_tok_s"] / b["batch32_tok_s"]
                                         for b, f in zip(runs[BASE], figs, strict=True))}
    table = report.simple_table(
        ["system", "batch-1 TPOT p50 ms", "TPOT speed-up (paired)", f"batch-{args.batch} out tok/s",
         "throughput ratio (paired)", "acceptance", "per position"],
        [_row(name, med[name], paired[name]) for name in runs])
    text = (f"# `make run SPEC=1` on SmolLM2-135M-Instruct (Q4_1 GGUF, this CPU)\n\n"
            f"`SPEC_CONFIG` = `{config}`\n\n{len(grounded)} input-grounded prompts one at a time (greedy, up to "
            f"{args.max_tokens} tokens), then {args.batch} chat questions at once (64 tokens); {args.reps} "
            f"interleaved repetitions, medians; paired = the median of per-repetition ratios against no "
            f"speculation.\n\n{table}\n\nCommand: `python -m bench.studies.spec_make_run --reps {args.reps} "
            f"--max-tokens {args.max_tokens} --held-out {args.held_out} --batch {args.batch}"
            f"{' --candidates ' + ' '.join(map(str, args.candidates)) if args.candidates else ''}`\n")
    print("\n" + text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "spec_make_run.md").write_text(text)
    report.write_json(args.results_dir / "spec_make_run.json",
                      {"spec_config": config, "runs": runs, "medians": med, "paired": paired})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
