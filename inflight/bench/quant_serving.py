"""``python -m inflight.bench quant``: one GGUF file served packed, dequantized and by llama.cpp.

Serves SmolLM2-135M-Instruct's ``Q4_1`` GGUF file (from PyPI, see
:mod:`inflight.runtime.model.gguf_smollm2`) three ways, one server at a time, in interleaved
rounds (the order rotates each round): ``inflight serve --quantization gguf`` (the file's
Q4_1/Q8_0 blocks kept packed and multiplied by the native kernels), ``inflight serve
--quantization none`` (dequantized to float32) and llama.cpp's ``llama-server -m FILE --jinja``
(built by :func:`inflight.bench.peers.ensure_llama_server`; skipped with its reason when it
cannot be built). inflight is given the converted directory, which links back to the same file.
For each server and round it measures the resident memory of its process tree after warm-up
and after the burst (VmRSS summed over the server and every descendant, e.g. inflight's engine
core; PSS beside it, since summed RSS counts shared pages twice; read by
:mod:`inflight.bench.proc_memory`), TPOT at batch 1 (one streaming greedy chat request at a
time) and a burst of streaming greedy chat requests (output tok/s, TTFT p50/p99; sent by
:mod:`inflight.bench.chat_client`). Every server gets the same chat messages and ``max_tokens``
with ``ignore_eos``; the report checks the token counts each server returns (``usage``, or
llama.cpp's ``timings``) and its prompt token counts, and compares the greedy batch-1 texts.
KV caches are sized alike in tokens (requests x the longest prompt + output, rounded up).
Writes ``quant.json`` and ``quant.md``. A benchmark: asserts nothing about speed, and knows
nothing about how the kernels or the engine work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inflight.bench import peers, report, roofline, stats
from inflight.bench.chat_client import chat, chat_body
from inflight.bench.client import RunResult
from inflight.bench.proc_memory import total_mib, tree_memory
from inflight.bench.smollm2 import QUESTIONS
from inflight.bench.systems import RunningServer, SystemSpec
from inflight.runtime.model.gguf_smollm2 import ensure_smollm2

logger = logging.getLogger("inflight.bench.quant")
PACKED = "inflight --quantization gguf (packed)"
DEQUANT = "inflight --quantization none (float32)"
LLAMA = "llama.cpp llama-server (GGUF)"
FRAMINGS = ("", "In one paragraph: ", "Briefly: ", "For a beginner: ")  # x QUESTIONS: distinct prompts
BLOCK_SIZE = 16  # inflight's default KV block size


@dataclass(frozen=True, slots=True)
class QuantOptions:
    results_dir: Path = Path("bench/results")
    models_dir: Path = Path("models")
    peers_dir: Path = Path("bench/.work")
    rounds: int = 2
    burst_requests: int = 64
    b1_requests: int = 4
    max_tokens: int = 64
    with_llama_cpp: bool = True  # False: measure the two inflight servers only

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.burst_requests < 1 or self.b1_requests < 1 or self.max_tokens < 2:
            raise ValueError("rounds, burst_requests and b1_requests must be >= 1, max_tokens >= 2")
        if self.burst_requests + self.b1_requests > len(FRAMINGS) * len(QUESTIONS):
            raise ValueError(f"at most {len(FRAMINGS) * len(QUESTIONS)} distinct prompts in all")


QUICK = dict(rounds=1, burst_requests=8, b1_requests=2, max_tokens=32)


# --- the plan: prompts, KV sizing, systems ---


def questions(num: int, offset: int = 0) -> list[str]:
    """``num`` distinct questions (a framing x a SmolLM2 question), starting at ``offset``."""
    return [FRAMINGS[i // len(QUESTIONS)] + QUESTIONS[i % len(QUESTIONS)] for i in range(offset, offset + num)]


def context_per_sequence(prompt_lengths: Sequence[int], max_tokens: int, multiple: int = 64) -> int:
    """Tokens of KV each sequence needs: the longest prompt + output + a margin, rounded up."""
    need = max(prompt_lengths) + max_tokens + 8
    return -(-need // multiple) * multiple


def kv_cache_mib(model_dir: Path, num_tokens: int, bytes_per_value: int) -> float:
    """Size of a K+V cache of ``num_tokens`` tokens for the model in ``model_dir``."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return num_tokens * cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * bytes_per_value / 2**20


def build_systems(llama_server: str, gguf: Path, num_seqs: int, ctx: int, cores: int) -> list[SystemSpec]:
    """The two inflight servers and, when built, llama-server; all sized for ``num_seqs`` x ``ctx``."""
    sizing = ("--max-num-seqs", str(num_seqs), "--num-kv-blocks", str(num_seqs * ctx // BLOCK_SIZE),
              "--max-model-len", str(ctx))
    systems = [SystemSpec(PACKED, "inflight", ("--quantization", "gguf", *sizing)),
               SystemSpec(DEQUANT, "inflight", ("--quantization", "none", *sizing))]
    if llama_server:
        # LLAMA_SERVER_FLAGS is --no-repack, which costs nothing here: Q4_1 has no repacked layout on x86.
        flags = ("-np", str(num_seqs), "-cb", "-c", str(num_seqs * ctx), "-t", str(cores), "-tb", str(cores),
                 "--ignore-eos", "--jinja", *peers.LLAMA_SERVER_FLAGS)
        systems.append(SystemSpec(LLAMA, "llama-server", flags, exe=llama_server, model_file=str(gguf)))
    return systems


@dataclass(frozen=True, slots=True)
class Workload:
    burst: tuple[dict[str, Any], ...]
    b1: tuple[dict[str, Any], ...]
    max_tokens: int


@dataclass(slots=True)
class RoundRecord:
    """What one server measured in one round."""

    system: str
    round: int
    rss_warm_mib: float = math.nan
    pss_warm_mib: float = math.nan
    rss_burst_mib: float = math.nan
    procs_warm: list[dict[str, Any]] = field(default_factory=list)
    tpot_b1_s: list[float] = field(default_factory=list)
    b1_texts: list[str] = field(default_factory=list)
    burst: dict[str, float] = field(default_factory=dict)
    wrong_token_counts: int = 0  # requests whose output token count is not max_tokens
    chunks_vs_tokens: list[int] = field(default_factory=list)  # per burst request: tokens - content chunks
    prompt_tokens: list[int] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)  # distinct errors of batch-1 and burst requests
    log_facts: list[str] = field(default_factory=list)  # what the server's log says about its slots / KV
    load_average: float = math.nan


def measure(spec: SystemSpec, model_path: Path, work: Workload, log: Path, rnd: int) -> RoundRecord:
    """Start ``spec``, warm it up, then memory, batch-1 TPOT, the burst, memory again; stop it."""
    rec = RoundRecord(spec.name, rnd, load_average=os.getloadavg()[0])
    with RunningServer(spec, model_path, log) as server:
        assert server.proc is not None  # started by __enter__
        warm, _ = chat(server.url, [chat_body("Say hello.", 8)], at_once=False)
        if warm[0].result.error:
            raise RuntimeError(f"{spec.name}: chat warm-up failed: {warm[0].result.error}")
        procs = tree_memory(server.proc.pid)
        rec.rss_warm_mib, rec.pss_warm_mib = total_mib(procs), total_mib(procs, pss=True)
        rec.procs_warm = [dataclasses.asdict(p) for p in procs]
        b1, _ = chat(server.url, work.b1, at_once=False)
        rec.tpot_b1_s = [t for r in b1 if (t := r.result.tpot_s) is not None]
        rec.b1_texts = [r.text for r in b1]
        burst, wall = chat(server.url, work.burst, at_once=True)
        rec.rss_burst_mib = total_mib(tree_memory(server.proc.pid))
    results = [r.result for r in burst]
    rec.burst = stats.to_dict(stats.summarize(RunResult(tuple(results), wall)))
    rec.wrong_token_counts = sum(r.num_output_tokens != work.max_tokens for r in results + [r.result for r in b1])
    rec.chunks_vs_tokens = [r.result.num_output_tokens - r.num_chunks for r in burst]
    rec.prompt_tokens = [r.num_prompt_tokens for r in results]
    rec.error_samples = sorted({r.error for r in results + [r.result for r in b1] if r.error})[:5]
    rec.log_facts = sorted(set(re.findall(r"n_slots = \d+, n_ctx_slot = \d+, kv_unified = '\w+'", log.read_text())))
    return rec


# --- the report ---


def _spread(values: Sequence[float]) -> stats.Spread:
    ok = [v for v in values if not math.isnan(v)]
    return stats.spread(ok) if ok else stats.Spread(math.nan, math.nan, math.nan)


def system_rows(records: Sequence[RoundRecord]) -> dict[str, dict[str, stats.Spread]]:
    """Per system, each reported figure as the median (min-max) over rounds."""
    rows: dict[str, dict[str, stats.Spread]] = {}
    for name in dict.fromkeys(r.system for r in records):
        mine = [r for r in records if r.system == name]
        rows[name] = {
            "rss_warm_mib": _spread([r.rss_warm_mib for r in mine]),
            "pss_warm_mib": _spread([r.pss_warm_mib for r in mine]),
            "rss_burst_mib": _spread([r.rss_burst_mib for r in mine]),
            "tpot_b1_p50_s": _spread([stats.percentile(r.tpot_b1_s, 50) for r in mine]),
            **{k: _spread([r.burst[k] for r in mine]) for k in ("output_tok_s", "ttft_p50_s", "ttft_p99_s")},
            "errors": _spread([r.burst["errors"] for r in mine]),
            "wrong_token_counts": _spread([float(r.wrong_token_counts) for r in mine]),
        }
    return rows


def ratio(rows: Mapping[str, Mapping[str, stats.Spread]], a: str, b: str, metric: str) -> float:
    """median(a) / median(b) for ``metric``; NaN where either system is missing."""
    if a not in rows or b not in rows or not rows[b][metric].median:
        return math.nan
    return rows[a][metric].median / rows[b][metric].median


RATIOS = (("TPOT p50 at batch 1, packed / llama.cpp", PACKED, LLAMA, "tpot_b1_p50_s"),
          ("burst output tok/s, packed / llama.cpp", PACKED, LLAMA, "output_tok_s"),
          ("burst output tok/s, packed / dequantized", PACKED, DEQUANT, "output_tok_s"),
          ("TPOT p50 at batch 1, packed / dequantized", PACKED, DEQUANT, "tpot_b1_p50_s"),
          ("RSS after warm-up, packed / dequantized", PACKED, DEQUANT, "rss_warm_mib"),
          ("RSS after warm-up, packed / llama.cpp", PACKED, LLAMA, "rss_warm_mib"))
COLUMNS = (("rss_warm_mib", "RSS MiB (warm)", 1.0, "{:.0f}"), ("pss_warm_mib", "PSS MiB (warm)", 1.0, "{:.0f}"),
           ("rss_burst_mib", "RSS MiB (after burst)", 1.0, "{:.0f}"),
           ("tpot_b1_p50_s", "TPOT p50 b1 ms", 1e3, "{:.1f}"), ("output_tok_s", "burst out tok/s", 1.0, "{:.1f}"),
           ("ttft_p50_s", "TTFT p50 ms", 1e3, "{:.0f}"), ("ttft_p99_s", "TTFT p99 ms", 1e3, "{:.0f}"),
           ("errors", "errors", 1.0, "{:.0f}"), ("wrong_token_counts", "wrong token counts", 1.0, "{:.0f}"))


def agreement(records: Sequence[RoundRecord], reference: str = PACKED) -> list[str]:
    """Per system, how many batch-1 greedy answers (first round) equal ``reference``'s."""
    first = {r.system: r.b1_texts for r in records if r.round == 0}
    ref = first.get(reference)
    lines = []
    for name, texts in first.items():
        if name == reference or ref is None:
            continue
        same = sum(a == b for a, b in zip(texts, ref, strict=False))
        prefix = [common_prefix(a, b) for a, b in zip(texts, ref, strict=False) if a != b]
        where = f"; the others agree for their first {prefix} characters" if prefix else ""
        lines.append(f"- {name} vs {reference}: {same} of {len(ref)} greedy batch-1 answers identical{where}")
    return lines


def common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def quant_markdown(rows: Mapping[str, Mapping[str, stats.Spread]], facts: Mapping[str, Any],
                   notes: Sequence[str]) -> str:
    """The section's markdown: the table, the ratios, the checks and the caveat."""
    md = [f"## SmolLM2-135M-Instruct from one GGUF file ({facts['gguf']}): inflight packed vs dequantized vs "
          "llama.cpp", "",
          f"{facts['rounds']} interleaved round(s), one server at a time, order rotated each round; medians "
          f"(min-max) over rounds. Batch 1: {facts['b1_requests']} streaming greedy chat requests one after "
          f"another; burst: {facts['burst_requests']} at once; {facts['max_tokens']} output tokens each "
          f"(ignore_eos). KV asked for: {facts['kv_tokens']} tokens ({facts['burst_requests']} x {facts['ctx']}), "
          f"{facts['kv_mib_f32']:.0f} MiB float32 in inflight; llama.cpp (f16 KV) made "
          f"{facts['llama_kv_tokens']} tokens of it, {facts['llama_kv_mib_f16']:.0f} MiB (its log; it keeps at least "
          "256 per slot). RSS sums VmRSS over the server's process tree, PSS splits shared pages.", "",
          report.simple_table(("system", *(c[1] for c in COLUMNS)),
                              [(name, *(report.fmt_spread(row[k], s, p) for k, _t, s, p in COLUMNS))
                               for name, row in rows.items()]), "",
          report.simple_table(("ratio (of medians)", "value"),
                              [(title, "n/a" if math.isnan(v := ratio(rows, a, b, m)) else f"{v:.2f}x")
                               for title, a, b, m in RATIOS]), "",
          "### Checks", "", *notes, "",
          "### Caveat", "",
          f"Measured on a shared {facts['cores']}-core machine while other jobs ran (1-minute load average "
          f"{facts['load_min']:.1f}-{facts['load_max']:.1f} at the server starts); every server was measured "
          "in every round under whatever else was running, so the ratios are fairer than the absolute "
          "figures, which can move by tens of percent between runs. RSS after warm-up leaves out KV pages "
          "not yet written (inflight's zero-filled cache is only resident once used; llama.cpp clears its "
          "cache at start), so the after-burst column is the fairer memory comparison.", ""]
    return "\n".join(md)


def check_lines(records: Sequence[RoundRecord], max_tokens: int) -> list[str]:
    lines = []
    ref = next((r.prompt_tokens for r in records if r.system == PACKED), [])
    for name in dict.fromkeys(r.system for r in records):
        mine = [r for r in records if r.system == name]
        wrong = sum(r.wrong_token_counts for r in mine)
        prompts = "same as packed" if all(r.prompt_tokens == ref for r in mine) else "DIFFERENT from packed"
        chunks = sorted({d for r in mine for d in r.chunks_vs_tokens})
        lines += [f"- {name}: error: {e}" for e in sorted({e for r in mine for e in r.error_samples})]
        lines += [f"- {name}: its log: {f}" for f in sorted({f for r in mine for f in r.log_facts})]
        lines.append(f"- {name}: {wrong} request(s) with other than {max_tokens} output tokens; prompt token "
                     f"counts {prompts}; output tokens minus content chunks per request: {chunks}")
    return lines + agreement(records)


# --- the run ---


def llama_kv_tokens(records: Sequence[RoundRecord]) -> int:
    """Slots x tokens per slot, as llama-server's log states them (0 when it did not run)."""
    for rec in records:
        for fact in rec.log_facts:
            if m := re.search(r"n_slots = (\d+), n_ctx_slot = (\d+)", fact):
                return int(m[1]) * int(m[2])
    return 0


def prepare_llama(peers_dir: Path) -> tuple[str, str]:
    """llama-server's path, or "" and why it is unavailable."""
    try:
        return str(peers.ensure_llama_server(peers.PeerPaths(peers_dir))), ""
    except peers.PeerUnavailable as exc:
        logger.warning("llama.cpp skipped: %s", exc)
        return "", f"- {LLAMA} skipped: {exc}"


def make_workload(model_dir: Path, options: QuantOptions) -> tuple[Workload, int]:
    """The chat bodies (burst and batch-1 prompts are distinct) and the KV tokens per sequence."""
    from inflight.runtime.tokenizer import load_tokenizer

    burst_q = questions(options.burst_requests)
    b1_q = questions(options.b1_requests, offset=options.burst_requests)
    tok = load_tokenizer(model_dir)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in burst_q + b1_q]
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    work = Workload(tuple(chat_body(q, options.max_tokens) for q in burst_q),
                    tuple(chat_body(q, options.max_tokens) for q in b1_q), options.max_tokens)
    return work, context_per_sequence(lengths, options.max_tokens)


def run_quant(options: QuantOptions) -> dict[str, Any]:
    """Measure every system in interleaved rounds; write and return the record."""
    model_dir = ensure_smollm2(options.models_dir, logger.info)
    gguf = (model_dir / "source.gguf").resolve()
    llama_server, skipped = prepare_llama(options.peers_dir) if options.with_llama_cpp else ("", "")
    cores = roofline.usable_cores()
    work, ctx = make_workload(model_dir, options)
    num_seqs = max(options.burst_requests, 1)
    systems = build_systems(llama_server, gguf, num_seqs, ctx, cores)
    logs = options.peers_dir / "quant_logs"
    logs.mkdir(parents=True, exist_ok=True)
    records: list[RoundRecord] = []
    notes = [skipped] if skipped else []
    for rnd in range(options.rounds):
        for i in range(len(systems)):
            spec = systems[(i + rnd) % len(systems)]
            path = gguf if spec.kind == "llama-server" else model_dir
            log = logs / f"{re.sub(r'[^a-z0-9]+', '_', spec.name.lower()).strip('_')}.r{rnd}.log"
            logger.info("round %d: %s (log %s)", rnd + 1, spec.name, log)
            try:
                records.append(measure(spec, path, work, log, rnd))
            except (RuntimeError, TimeoutError, OSError) as exc:
                notes.append(f"- {spec.name}, round {rnd + 1} failed: {exc}")
                logger.warning("%s", notes[-1])
    rows = system_rows(records)
    loads = [r.load_average for r in records] or [math.nan]
    facts = {"gguf": gguf.name, "rounds": options.rounds, "b1_requests": options.b1_requests,
             "burst_requests": options.burst_requests, "max_tokens": options.max_tokens, "ctx": ctx,
             "kv_tokens": num_seqs * ctx, "kv_mib_f32": kv_cache_mib(model_dir, num_seqs * ctx, 4),
             "llama_kv_tokens": (llama_kv := llama_kv_tokens(records)),
             "llama_kv_mib_f16": kv_cache_mib(model_dir, llama_kv, 2), "cores": cores,
             "load_min": min(loads), "load_max": max(loads),
             "commands": {s.name: s.flags for s in systems}}
    notes = check_lines(records, options.max_tokens) + notes
    md = quant_markdown(rows, facts, notes)
    record = {"facts": facts, "rows": {n: report.spreads_to_json(r) for n, r in rows.items()},
              "ratios": {t: ratio(rows, a, b, m) for t, a, b, m in RATIOS}, "notes": notes,
              "rounds": [dataclasses.asdict(r) for r in records]}
    options.results_dir.mkdir(parents=True, exist_ok=True)
    (options.results_dir / "quant.md").write_text(md)
    report.write_json(options.results_dir / "quant.json", record)
    print(md)
    return record


def options_for(results_dir: Path, models_dir: Path, peers_dir: Path, quick: bool, rounds: int,
                with_llama_cpp: bool = True) -> QuantOptions:
    extra: dict[str, Any] = dict(QUICK) if quick else {"rounds": rounds}
    return QuantOptions(results_dir, models_dir, peers_dir, with_llama_cpp=with_llama_cpp, **extra)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inflight.bench.quant_serving",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--peers-dir", type=Path, default=Path("bench/.work"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 8-request burst, 32 tokens")
    parser.add_argument("--no-llama-cpp", action="store_true", help="only the two inflight servers")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_quant(options_for(args.results_dir, args.models_dir, args.peers_dir, args.quick, args.rounds,
                          not args.no_llama_cpp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
