"""Prompt-chunk attention on the CPU: the native kernel against the torch reference it replaced.

    python -m bench.cpu.prefill [--rounds 7] [--threads 2] [--engine MODEL_DIR]

Kernel part: each case is a prompt step (chunks of given lengths, whole prompts, as a 2048-token
step of the peers' burst holds them) over ``layers`` caches, called one layer after the other as
the decoder does, after the chunk's K/V are in the cache; the reference gets the chunk's own K/V
as the decoder passes them. FLOPs count the causal half: 4 x head_dim x heads x (visible keys)
per query. Engine part (``--engine``): the peers' medium burst offline (64 prompts, lognormal
lengths around 96, 64 output tokens each), in one process, the engine's prefill attention
switched between the native kernel and the reference in interleaved rounds; it prints the time
until every request has its first token. The machine is shared: read the ratios, measured side by
side. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from pathlib import Path

from inflight.runtime.config import EngineConfig  # noqa: F401 - sets passive OpenMP waits before torch loads

# (name, prompt lengths, heads, kv_heads, head_dim, block_size, layers)
CASES = (
    ("22 x 93 tokens, bench-medium", [93] * 22, 8, 4, 64, 16, 18),
    ("lognormal prompts, bench-medium", [384, 250, 181, 160, 140, 120, 110, 96, 96, 90, 80, 74, 64, 58, 50, 40,
                                         32, 25, 20, 12, 8], 8, 4, 64, 16, 18),
    ("8 x 256 tokens, d128 g4", [256] * 8, 16, 4, 128, 16, 4),
    ("4 x 512 tokens, d64 g2", [512] * 4, 8, 4, 64, 16, 4),
    ("one 2048-token prompt, d64 g2", [2048], 8, 4, 64, 16, 4),
    ("one 2048-token prompt, d128 g4", [2048], 16, 4, 128, 16, 2),
)


def _kernel_cases(rounds: int) -> None:
    import torch

    from inflight.kernels import cpu_native, reference

    for name, lens, heads, kv_heads, head_dim, block_size, layers in CASES:
        gen = torch.Generator().manual_seed(sum(lens))
        blocks = [-(-n // block_size) for n in lens]
        shape = (sum(blocks) + 1, block_size, kv_heads, head_dim)
        table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
        order = (torch.randperm(sum(blocks), generator=gen) + 1).tolist()
        for s, n in enumerate(blocks):
            table[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
            order = order[n:]
        starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        ctx = torch.tensor(lens, dtype=torch.int32)
        layer_inputs = []
        for _ in range(layers):
            k = torch.randn(sum(lens), kv_heads, head_dim, generator=gen)
            v = torch.randn(sum(lens), kv_heads, head_dim, generator=gen)
            k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
            slots = torch.cat([table[s, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                               for s, n in enumerate(lens)])  # fmt: skip
            k_cache.view(-1, kv_heads, head_dim)[slots] = k
            v_cache.view(-1, kv_heads, head_dim)[slots] = v
            layer_inputs.append((torch.randn(sum(lens), heads, head_dim, generator=gen), k_cache, v_cache, k, v))
        kernels = {"native": cpu_native.paged_prefill_attention, "reference": reference.paged_prefill_attention}
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for rnd in range(rounds):
            for key in (list(kernels) if rnd % 2 == 0 else list(kernels)[::-1]):
                t0 = time.perf_counter()
                for q, k_cache, v_cache, k, v in layer_inputs:
                    kernels[key](q, k_cache, v_cache, table, starts, ctx, 0.1, key=k, value=v)
                times[key].append(time.perf_counter() - t0)
        flops = layers * sum(4 * head_dim * heads * n * (n + 1) / 2 for n in lens)
        cells = [f"{key} {statistics.median(ts) * 1e3:6.1f} ms {flops / statistics.median(ts) / 1e9:5.1f} GFLOP/s"
                 for key, ts in times.items()]  # fmt: skip
        ratio = statistics.median([r / n for r, n in zip(times["reference"], times["native"], strict=True)])
        print(f"{name:34s} {sum(lens):5d} tokens x {layers} layers | " + " | ".join(cells)
              + f" | native x{ratio:.2f}", flush=True)  # fmt: skip


def _engine_burst(model_dir: Path, rounds: int) -> None:
    import dataclasses

    from inflight.kernels import reference
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.sampling_params import SamplingParams

    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(device="cpu"))
    engine.warmup()
    native = engine.runner.ops
    variants = {"native": native,
                "reference": dataclasses.replace(native, paged_prefill_attention=reference.paged_prefill_attention)}
    rng = random.Random(0)
    lens = [max(4, min(384, round(96 * math.exp(rng.gauss(0, 0.8))))) for _ in range(64)]
    vocab = engine.runner.spec.vocab_size
    firsts: dict[str, list[float]] = {k: [] for k in variants}
    for rnd in range(rounds):
        for key in (list(variants) if rnd % 2 == 0 else list(variants)[::-1]):
            engine.runner.ops = variants[key]
            for i, n in enumerate(lens):  # fresh random prompts: no prefix-cache hits between rounds
                engine.add_request(f"{key}-{rnd}-{i}", [rng.randrange(10, vocab) for _ in range(n)],
                                   SamplingParams(max_tokens=64, ignore_eos=True, temperature=0))  # fmt: skip
            t0, seen = time.perf_counter(), set()
            while len(seen) < len(lens):
                seen.update(out.req_id for out in engine.step())
            firsts[key].append(time.perf_counter() - t0)
            while engine.has_unfinished_requests():
                engine.step()
    engine.runner.ops = native
    ratio = statistics.median([r / n for r, n in zip(firsts["reference"], firsts["native"], strict=True)])
    print(f"engine, {sum(lens)} prompt tokens in 64 requests: every first token after "
          + " | ".join(f"{k} {statistics.median(v):.2f} s" for k, v in firsts.items()) + f" | native x{ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", type=Path, default=None, help="a model directory (e.g. bench-medium)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s), {args.rounds} interleaved rounds, medians")
    _kernel_cases(args.rounds)
    if args.engine is not None:
        _engine_burst(args.engine, max(2, args.rounds // 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
