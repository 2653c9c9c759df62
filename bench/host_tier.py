"""The host KV tier on a multi-turn chat workload: prefill tokens computed and TTFT with and
without ``kv_offloading_size``, side by side in one process.

    python -m bench.host_tier [--chats 8] [--turns 4] [--system-len 64] [--context-len 192]
        [--user-len 24] [--max-tokens 16] [--device-blocks 0] [--offload-gib 0.25] [--rounds 2]
        [--model small] [--models-dir models] [--json FILE]

Two in-process engines on ``models/bench-<model>`` (the benchmark suite's random-weight llama;
float32 on the CPU, block size 16), the same but for the host tier: ``device only`` and ``host
tier`` (``--offload-gib``). The workload: ``--chats`` chats run at once, closed loop (a chat's
next turn is added the moment its reply finishes); every chat starts with a shared system prompt
(``--system-len``) and a context of its own (``--context-len``: a document, an agent's tools),
and each turn adds ``--user-len`` user tokens to the chat so far (earlier turns and their
greedy replies of ``--max-tokens``). The device pool (``--device-blocks``; 0: a third of the
blocks the chats end with, and never less than two chats' worth) is too small for every chat's
history, so by the time a chat comes back its blocks were evicted: without the tier they are
recomputed, with it they are copied back.

Every round runs both variants on fresh prompts (no hit crosses rounds or variants), in rotated
order. The report gives per variant the prompt tokens computed by prefill, the prompt tokens hit
on the device and in the host tier, TTFT p50 and p99 (ms, from a turn's arrival to its first
token), the wall time, the copies and their bytes, and whether every reply's tokens are the same
as the other variant's (they must be: the tier is exact). The machine is shared and noisy:
read the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inflight.runtime.config import EngineConfig  # inflight.runtime sets passive OpenMP waits before torch loads
from inflight.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

BLOCK = 16


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.host_tier", description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=192)
    parser.add_argument("--user-len", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--device-blocks", type=int, default=0)
    parser.add_argument("--offload-gib", type=float, default=0.25)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="small", choices=("tiny", "small", "medium"))
    parser.add_argument("--models-dir", type=Path, default=Path("models"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    for name in ("chats", "turns", "user_len", "max_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.chats > 64 or args.turns > 16 or args.rounds > 10 or final_len(args) > 4096:
        parser.error("keep it bounded: --chats <= 64, --turns <= 16, --rounds <= 10, a chat's last prompt <= 4096")
    return args


def final_len(args: argparse.Namespace) -> int:
    """Tokens of a chat's last prompt and reply."""
    return args.system_len + args.context_len + args.turns * (args.user_len + args.max_tokens)


def device_blocks(args: argparse.Namespace) -> int:
    per_chat = -(-final_len(args) // BLOCK) + 1
    return args.device_blocks or max(args.chats * per_chat // 3, 2 * per_chat)


def run_chats(engine: LLMEngine, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The closed-loop chats on ``engine``: replies, TTFTs and the engine's counters."""
    rng = random.Random(seed)
    vocab = engine.runner.spec.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(5, vocab - 5) for _ in range(n)]

    system = tokens(args.system_len)
    history = [system + tokens(args.context_len) for _ in range(args.chats)]
    user = [[tokens(args.user_len) for _ in range(args.turns)] for _ in range(args.chats)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    before = engine.stats()
    replies: dict[str, list[int]] = {}
    arrived: dict[str, float] = {}
    ttft: list[float] = []
    turn = [0] * args.chats

    def add(chat: int) -> None:
        req_id = f"{chat}-{turn[chat]}"
        history[chat] = history[chat] + user[chat][turn[chat]]
        arrived[req_id] = time.perf_counter()
        engine.add_request(req_id, history[chat], params)

    start = time.perf_counter()
    for chat in range(args.chats):
        add(chat)
    while engine.has_unfinished_requests():
        for out in engine.step():
            reply = replies.setdefault(out.req_id, [])
            if not reply and out.new_token_ids:
                ttft.append(time.perf_counter() - arrived[out.req_id])
            reply.extend(out.new_token_ids)
            if out.finished:
                chat = int(out.req_id.split("-")[0])
                history[chat] = history[chat] + reply
                turn[chat] += 1
                if turn[chat] < args.turns:
                    add(chat)
    wall = time.perf_counter() - start
    after = engine.stats()
    ttft.sort()
    return {
        "replies": replies, "wall_s": wall,
        "ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "prefill_computed": after.num_prefill_computed_tokens - before.num_prefill_computed_tokens,
        "device_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "host_hits": after.external_prefix_cache_hits - before.external_prefix_cache_hits,
        "copied_blocks": (after.kv_offload_stored_blocks + after.kv_offload_loaded_blocks
                          - before.kv_offload_stored_blocks - before.kv_offload_loaded_blocks),
        "copied_bytes": after.kv_offload_bytes - before.kv_offload_bytes,
        "preemptions": after.num_preemptions - before.num_preemptions,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from inflight.bench.suite import SuiteOptions, bench_model
    from inflight.runtime.core.engine import LLMEngine

    model_dir = bench_model(SuiteOptions(models_dir=args.models_dir), args.model)
    common = {"max_num_sequences": args.chats, "max_model_len": final_len(args) + BLOCK, "block_size": BLOCK,
              "dtype": "float32", "num_kv_blocks": device_blocks(args), "device": "cpu"}  # fmt: skip
    variants = {"device only": EngineConfig(**common),
                "host tier": EngineConfig(**common, kv_offloading_size=args.offload_gib)}  # fmt: skip
    engines = {name: LLMEngine.from_model_dir(model_dir, config) for name, config in variants.items()}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    same = True
    try:
        for engine in engines.values():
            engine.warmup()
        names = list(engines)
        for r in range(args.rounds):
            order = names[r % 2:] + names[: r % 2]
            for name in order:
                engines[name].pool.reset_prefix_cache()  # fresh caches: only this round's hits count
                results[name].append(run_chats(engines[name], args, seed=1000 + r))
            same = same and results[names[0]][-1]["replies"] == results[names[1]][-1]["replies"]
        host_kv = engines["host tier"].host_kv
        host_blocks = host_kv.num_slots if host_kv is not None else 0
    finally:
        for engine in engines.values():
            engine.close()
    report(args, results, same, host_blocks)
    if args.json is not None:
        rows = {name: [{k: v for k, v in run.items() if k != "replies"} for run in runs]
                for name, runs in results.items()}  # fmt: skip
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "same_tokens": same,
                                         "device_blocks": device_blocks(args), "runs": rows}, indent=2))
    return 0 if same else 1


def report(args: argparse.Namespace, results: dict[str, list[dict[str, Any]]], same: bool, host_blocks: int) -> None:
    print(f"model bench-{args.model}: {args.chats} chats x {args.turns} turns (system {args.system_len} + context "
          f"{args.context_len} tokens, {args.user_len} user + {args.max_tokens} reply tokens a turn); device pool "
          f"{device_blocks(args)} blocks of {BLOCK}, host tier {host_blocks} blocks; {args.rounds} round(s), medians")
    cols = ("prefill_computed", "device_hits", "host_hits", "ttft_p50_ms", "ttft_p99_ms", "wall_s", "copied_blocks",
            "copied_bytes", "preemptions")  # fmt: skip
    print(f"{'variant':<12} " + " ".join(f"{c:>16}" for c in cols))
    medians = {name: {c: statistics.median(run[c] for run in runs) for c in cols} for name, runs in results.items()}
    for name, row in medians.items():
        print(f"{name:<12} " + " ".join(f"{row[c]:>16.1f}" if isinstance(row[c], float) else f"{row[c]:>16}"
                                        for c in cols))  # fmt: skip
    base, tier = medians["device only"], medians["host tier"]
    for c in ("prefill_computed", "ttft_p50_ms", "ttft_p99_ms", "wall_s"):
        print(f"host tier / device only, {c}: {tier[c] / base[c]:.2f}" if base[c] else f"{c}: no base figure")
    print("same tokens in every reply: " + ("yes" if same else "NO (the tier must be exact: a bug)"))


if __name__ == "__main__":
    sys.exit(main())
