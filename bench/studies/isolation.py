"""``python -m bench.studies.isolation``: issue 19's "Must show" figures for cost isolation.

On a real ``inflight serve`` (the small bench model, 127.0.0.1, engine-core process), with
repetitions interleaved (alone, beside, alone, beside, ...):

* **grammar isolation**: a victim stream's inter-token gaps (p50, p99) alone, beside the hog's
  *free twin* (the same request without its grammar: only a larger batch) and beside a request
  (``n`` rows) whose ambiguous Lark grammar makes every mask slower as its output grows (a real
  grammar, no injected fault), and how that request ends (status, code or finish reason);
* **parser stall**: ``/health`` latency and a victim stream's gaps alone, beside a free twin and beside a chat stream
  with ``tools`` whose regex makes the model write an unclosed Llama 3 tool call (the bench
  model's convention: ``{"name": "f", "parameters": {"a": "`` and a run of spaces). The
  model's context (2048 tokens) bounds that text to ~1.9k characters, so the 100k-character
  case is timed separately, in this process: :class:`ToolStream` (Hermes: ``<tool_call>x``, spaces,
  ``y``, the shape the old pattern backtracked over) fed 100k characters in
  4-character deltas, as a stream hands them to the front end's loop (its total time bounds
  what it can add to the loop);
* **grammar memory**: the server tree's summed RSS after each 10 of 100 distinct large JSON
  schemas (each compiled, one token generated), against the grammar cache's byte budget;
* **logprobs response**: ``/health`` latency while the largest prompt-logprobs response the
  ceiling allows (``MAX_RESPONSE_ENTRIES``) is built and sent, against idle.

Optionally (``--hostile N``) it runs ``python -m tests.hostile N`` and adds its summary.
Writes ``isolation.md`` / ``.json`` under the results directory; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.studies.isolation_probes import (
    AMBIGUOUS_GRAMMAR,
    health_poller,
    parser_100k,
    percentile,
    stream_gaps,
    wide_schema,
)
from bench.studies.supervision import run_hostile
from inflight.bench import report
from inflight.bench.proc_memory import total_mib, tree_memory
from inflight.bench.suite import SuiteOptions, bench_model
from inflight.bench.systems import RunningServer, SystemSpec

logger = logging.getLogger("bench.studies.isolation")

VICTIM_TOKENS = 160
GRAMMAR_N = 4
NUM_SCHEMAS = 100
SCHEMA_PROPS = 2000
TOOL_SPACES = 1800
# The bench model speaks Llama 3's tool-call convention: a call object whose string never closes.
TOOL_REGEX = f'\\{{"name": "f", "parameters": \\{{"a": " {{{TOOL_SPACES}}}'
TARGETS = {"grammar": 1.5, "parser": 1.10, "health_ms": 200.0}
PARTS = ("grammar", "parser", "schemas", "logprobs")


async def _grammar_request(session: aiohttp.ClientSession, url: str, grammar: bool = True) -> dict[str, Any]:
    """The ambiguous-grammar request, or (``grammar=False``) the same request without it."""
    body: dict[str, Any] = {"model": "bench", "prompt": "x", "max_tokens": 400, "temperature": 1.0, "n": GRAMMAR_N,
                            "logit_bias": {"1": -100}}  # 1: EOS, so it runs on
    if grammar:
        body["guided_grammar"] = AMBIGUOUS_GRAMMAR
    t0 = time.monotonic()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        data = await resp.json(content_type=None)
    out: dict[str, Any] = {"status": resp.status, "seconds": time.monotonic() - t0}
    if "error" in data:
        out["code"], out["message"] = data["error"].get("code"), data["error"]["message"][:200]
    else:
        out["finish"] = [c["finish_reason"] for c in data["choices"]]
        out["tokens"] = data["usage"]["completion_tokens"]
    return out


async def _tool_stream(session: aiohttp.ClientSession, url: str, tools: bool = True) -> dict[str, Any]:
    """The adversarial tool-call stream, or (``tools=False``) a free stream of the same length."""
    body: dict[str, Any] = {"model": "bench", "messages": [{"role": "user", "content": "call f"}], "stream": True,
                            "max_tokens": 1900, "temperature": 0}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        body["guided_regex"] = TOOL_REGEX
    else:
        body["ignore_eos"] = True
    chars, finish, t0 = 0, None, time.monotonic()
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        async for raw in resp.content:
            if raw.startswith(b"data: {"):
                for choice in json.loads(raw[6:]).get("choices", []):
                    chars += len(choice["delta"].get("content") or "")
                    finish = choice.get("finish_reason") or finish
    return {"status": resp.status, "chars": chars, "finish": finish, "seconds": time.monotonic() - t0}


async def _repeat(make: Any, stop: asyncio.Event) -> list[dict[str, Any]]:
    """``make()`` again and again until ``stop`` is set (the hog outlasts the victim)."""
    ends = [await make()]
    while not stop.is_set():
        ends.append(await make())
    return ends


async def _beside(make: Any, victim: Any) -> tuple[Any, list[dict[str, Any]]]:
    stop = asyncio.Event()
    hog = asyncio.create_task(_repeat(make, stop))
    await asyncio.sleep(0.3)
    result = await victim
    stop.set()
    return result, await hog


async def _isolation(url: str, reps: int, parts: set[str]) -> dict[str, Any]:
    """Victim gaps alone, beside the same-shaped free request, and beside the hog (interleaved)."""
    out: dict[str, Any] = {k: [] for k in ("grammar_alone", "grammar_free", "grammar_beside", "grammar_request",
                                           "parser_alone", "parser_free", "parser_beside", "tool_request",
                                           "health_alone", "health_beside")}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        def victim() -> Any:
            return stream_gaps(session, url, VICTIM_TOKENS)

        for rep in range(reps):
            if "grammar" in parts:
                out["grammar_alone"].append(await victim())
                gaps, _ = await _beside(lambda: _grammar_request(session, url, grammar=False), victim())
                out["grammar_free"].append(gaps)
                gaps, ends = await _beside(lambda: _grammar_request(session, url), victim())
                out["grammar_beside"].append(gaps)
                out["grammar_request"] += ends
                logger.info("rep %d: grammar requests %s", rep, ends)
            if "parser" in parts:
                async with health_poller(session, url) as health:
                    out["parser_alone"].append(await victim())
                out["health_alone"].append(health.latencies)
                gaps, _ = await _beside(lambda: _tool_stream(session, url, tools=False), victim())
                out["parser_free"].append(gaps)
                async with health_poller(session, url) as health:
                    gaps, ends = await _beside(lambda: _tool_stream(session, url), victim())
                out["parser_beside"].append(gaps)
                out["health_beside"].append(health.latencies)
                out["tool_request"] += ends
                logger.info("rep %d: tool streams %s", rep, ends)
    return out


async def _schemas(url: str, root_pid: int) -> list[tuple[int, float]]:
    rss = [(0, total_mib(tree_memory(root_pid)))]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for i in range(NUM_SCHEMAS):
            body = {"model": "bench", "prompt": "x", "max_tokens": 1, "guided_json": wide_schema(SCHEMA_PROPS, i)}
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    logger.info("schema %d: %d %s", i, resp.status, (await resp.text())[:200])
            if (i + 1) % 10 == 0:
                rss.append((i + 1, total_mib(tree_memory(root_pid))))
                logger.info("after %d schemas: %.0f MiB", i + 1, rss[-1][1])
    return rss


async def _logprobs(url: str, reps: int) -> dict[str, Any]:
    from inflight.runtime.server.openai.generation import MAX_RESPONSE_ENTRIES

    n, num_prompts, k = 16, 16, 20
    tokens = MAX_RESPONSE_ENTRIES // (n * num_prompts * (1 + k)) - 1  # max_tokens=1 adds 1 entry each
    prompts = [[5 + (i * 7 + j) % 4000 for j in range(tokens)] for i in range(num_prompts)]
    body = {"model": "bench", "prompt": prompts, "n": n, "max_tokens": 1, "prompt_logprobs": k}
    entries = n * num_prompts * (tokens * (1 + k) + 1)
    out: dict[str, Any] = {"entries": entries, "ceiling": MAX_RESPONSE_ENTRIES, "idle": [], "during": [], "runs": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(reps):
            async with health_poller(session, url) as health:
                await asyncio.sleep(2.0)
            out["idle"].append(health.latencies)
            async with health_poller(session, url) as health:
                t0 = time.monotonic()
                async with session.post(f"{url}/v1/completions", json=body) as resp:
                    size = len(await resp.read())
                out["runs"].append({"status": resp.status, "bytes": size, "seconds": time.monotonic() - t0})
            out["during"].append(health.latencies)
    return out


def _p(values: list[list[float]], q: float) -> list[float]:
    return [1e3 * percentile(v, q) for v in values if v]


def _span(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-"


def summarize(iso: dict[str, Any], rss: list[tuple[int, float]], lp: dict[str, Any], budget_mib: float,
              parser: dict[str, float]) -> list[list[Any]]:
    """The table's rows for the parts that ran. Each victim ratio is against the victim alone
    (the issue's target) and, in brackets, against the victim beside the same request made
    harmless (no grammar, no tools): that part of the gap is only the larger batch."""
    rows = []

    def med(key: str, q: float) -> float:
        return statistics.median(_p(iso[key], q))

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    def victim_row(what: str, hog: str, q: float, target: float | None) -> None:
        ratio = med(f"{hog}_beside", q) / med(f"{hog}_alone", q)
        free = med(f"{hog}_beside", q) / med(f"{hog}_free", q)
        rows.append([f"victim gap p{q:g} beside {what}, ms", _span(_p(iso[f"{hog}_alone"], q)),
                     f"{_span(_p(iso[f'{hog}_beside'], q))} [free twin {_span(_p(iso[f'{hog}_free'], q))}]",
                     f"{ratio:.2f}x [{free:.2f}x]", f"<= {target}x" if target else "-",
                     verdict(ratio <= target) if target else "-"])

    if iso["grammar_alone"]:
        victim_row("an ambiguous grammar", "grammar", 50, TARGETS["grammar"])
        victim_row("an ambiguous grammar", "grammar", 99, None)
    if iso["parser_alone"]:
        victim_row("adversarial tool-call text", "parser", 50, TARGETS["parser"])
        victim_row("adversarial tool-call text", "parser", 99, TARGETS["parser"])
        h = med("health_beside", 99) / med("health_alone", 99)
        rows.append(["/health p99 beside adversarial tool-call text, ms", _span(_p(iso["health_alone"], 99)),
                     _span(_p(iso["health_beside"], 99)), f"{h:.2f}x", "<= 1.10x", verdict(h <= 1.10)])
        rows.append(["ToolStream, 100k adversarial chars in 4-char deltas (in-process), ms", "-",
                     f"{parser['total_ms']:.1f} (max delta {parser['max_delta_ms']:.2f})", "-", "-", "-"])
    if rss:
        grown = max(r for _, r in rss) - rss[0][1]
        rows.append([f"server RSS growth after {NUM_SCHEMAS} distinct {SCHEMA_PROPS}-property schemas, MiB",
                     f"{rss[0][1]:.0f}", f"{rss[-1][1]:.0f} (peak +{grown:.0f})", "-",
                     f"<= {budget_mib:.0f} (cache budget)", verdict(grown <= budget_mib)])
    if lp.get("during"):
        worst = max(_p(lp["during"], 99))
        rows.append([f"/health p99 while a {lp['entries']:,}-entry prompt-logprobs response is built, ms",
                     _span(_p(lp["idle"], 99)), _span(_p(lp["during"], 99)), "-", "< 200", verdict(worst < 200)])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.studies.isolation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--hostile", type=int, default=0, metavar="N", help="also run `python -m tests.hostile N`")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    args = parser.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        parser.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {','.join(PARTS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from inflight.runtime.structured.cache import DEFAULT_MAX_BYTES

    model_dir = bench_model(SuiteOptions(results_dir=args.results_dir, models_dir=args.models_dir), "small")
    log_dir = Path("bench/.work/isolation_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = SystemSpec("inflight", "inflight", ("--max-model-len", "2048"))
    with RunningServer(spec, model_dir, log_dir / "isolation.log") as server:
        assert server.proc is not None
        iso = asyncio.run(_isolation(server.url, args.reps, parts))
        lp = asyncio.run(_logprobs(server.url, args.reps)) if "logprobs" in parts else {}
        rss = asyncio.run(_schemas(server.url, server.proc.pid)) if "schemas" in parts else []
    parser_fig = parser_100k()
    budget_mib = DEFAULT_MAX_BYTES / 2**20
    rows = summarize(iso, rss, lp, budget_mib, parser_fig)
    hostile = run_hostile(args.hostile) if args.hostile > 0 else None
    text = render(rows, iso, lp, rss, args.reps, hostile)
    print("\n" + text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "isolation.md").write_text(text)
    report.write_json(args.results_dir / "isolation.json", {
        "reps": args.reps, "rows": rows, "isolation": iso, "logprobs": lp, "rss_mib": rss,
        "cache_budget_mib": budget_mib, "parser_100k": parser_fig, "hostile": hostile})
    return 0


def render(rows: list[list[Any]], iso: dict[str, Any], lp: dict[str, Any], rss: list[tuple[int, float]],
           reps: int, hostile: dict[str, Any] | None) -> str:
    table = report.simple_table(["figure", "alone / idle", "beside / during", "ratio", "target", "verdict"], rows)
    text = (
        "# Cost isolation (issue 19)\n\n`inflight serve`, small bench model (4096-token vocabulary, 2048 "
        f"context), engine-core process, this 2-core CPU while other jobs ran (noisy: {reps} interleaved "
        "repetitions, median (min-max) of the per-repetition figures). Victim: a greedy "
        f"{VICTIM_TOKENS}-token stream, alone, beside the hog's free twin (the same request without its grammar "
        f"or tools: only a larger batch) and beside the hog. Grammar request: n={GRAMMAR_N}, "
        f"`{AMBIGUOUS_GRAMMAR.strip()!r}` (Earley; its masks grow with the output past the 0.5 s per-mask "
        "deadline), run back to back from 0.3 s before the victim until it ends, EOS biased away. Tool-call text: "
        f"`{{'name': 'f', 'parameters': {{'a': '` (double quotes) and {TOOL_SPACES} spaces (an "
        "unclosed call), streamed with `tools`, back to back the same way. /health polled every 10 ms.\n\n"
        + table + "\n\n")
    if iso["grammar_request"]:
        text += f"Grammar requests ended: {[_end(r) for r in iso['grammar_request']]}.\n\n"
    if iso["tool_request"]:
        text += f"Tool-call streams: {[_end(r) for r in iso['tool_request']]}.\n\n"
    if lp:
        runs = [(r["status"], f"{r['bytes'] / 2**20:.0f} MiB", f"{r['seconds']:.1f} s") for r in lp["runs"]]
        text += (f"Largest prompt-logprobs request: {lp['entries']:,} entries (ceiling {lp['ceiling']:,}); runs: "
                 f"{runs}.\n\n")
    if rss:
        text += ("Server RSS (MiB, summed over the process tree) after each 10 schemas: "
                 f"{', '.join(f'{n}: {m:.0f}' for n, m in rss)}.\n")
    text += NOTES
    if hostile is not None:
        summary = "\n".join(f"    {line}" for line in hostile["summary"])
        text += (f"\n## Hostile suite\n\n`python -m tests.hostile {hostile['examples']}` (exit code "
                 f"{hostile['exit_code']}, {hostile['seconds']:.0f} s wall):\n\n{summary}\n")
    return text


NOTES = (
    "\nReading it: a constrained row whose token mask is not ready when its step samples leaves the step: its "
    "request is parked until the mask is (its last position is recomputed then), its grammar is marked slow, "
    "and a slow grammar's masks and its advances past each token run off the step on lowest-priority threads "
    "(`runtime/structured/mask_fills.py`, `runtime/parked.py`). A mask or advance that costs more than 0.5 "
    "CPU-seconds ends its request with a 400 `constraint_failed`, never `stop`. So the victim's gaps beside "
    "the ambiguous grammar are those of the victim alone; its free twin, which does share the batch, costs "
    "the victim more. For the tool-call rows the parser's share is the bracketed ratio against the free twin "
    "(the same stream without tools or regex); the ratio against the victim alone also counts the second "
    "sequence in the batch. The in-process parse of 100k adversarial characters is the parser's whole cost. "
    "The 2000-property schemas compile and are cached, then fail at their first token (llguidance's "
    "2000-items-per-row limit: a 400 `constraint_failed`); RSS stops growing once the cache is full (it "
    "evicts by its byte estimate). The non-streamed prompt-logprobs response is built and serialized on the "
    "worker pool, off the event loop.\n")


def _end(r: dict[str, Any]) -> str:
    what = r.get("code") or r.get("finish")
    return f"{r['status']} {what} after {r['seconds']:.1f} s"


if __name__ == "__main__":
    raise SystemExit(main())
