"""The native CPU decode attention alone, on one thread: GFLOP/s and K/V GB/s, against another build.

    python -m bench.cpu.attention [--alt-attention FILE] [--rounds 7]

Each case is a decode batch (sequences x context, heads, KV heads, head_dim, block size) over
``layers`` separate caches, called one layer after the other as a step does, so a case whose
caches outgrow the CPU's caches measures what a step sees (K/V streamed from memory) and a
one-layer case with few sequences measures the arithmetic (K/V in L2). FLOPs count 4 x context
x heads x head_dim per sequence (QK and PV); bytes count K and V once. With ``--alt-attention
FILE`` (a C file with the same ``inflight_paged_decode_attention_f32``, e.g. ``git show
REV:inflight/kernels/cpu_kernels.c``) both run, interleaved, and the ratio is alt time / current
time (median over rounds). The machine is shared: read the ratios. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from inflight.runtime.config import EngineConfig  # noqa: F401 - sets passive OpenMP waits before torch loads

# (name, sequences, context, heads, kv_heads, head_dim, block_size, layers)
CASES = (
    ("bench-small step (d32 g2)", 64, 140, 8, 4, 32, 16, 8),
    ("bench-medium step (d64 g2)", 64, 140, 8, 4, 64, 16, 18),
    ("d64 g1, 8 layers", 64, 140, 8, 8, 64, 16, 8),
    ("d128 g8, 8 layers", 16, 300, 32, 4, 128, 16, 8),
    ("in L2: d64 g2", 6, 140, 8, 4, 64, 16, 1),
    ("in L2: d32 g2", 12, 140, 8, 4, 32, 16, 1),
    ("in L2: d128 g8", 1, 300, 32, 4, 128, 16, 1),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alt-attention", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    import torch

    from bench.cpu.step import alt_attention
    from inflight.kernels import cpu_native

    kernels = {"current": cpu_native.paged_decode_attention}
    if args.alt_attention is not None:
        kernels["alt"] = alt_attention(args.alt_attention)
    torch.set_num_threads(1)
    print(f"one thread; {'alt = ' + str(args.alt_attention) if args.alt_attention else 'current build only'}")
    for name, seqs, ctx, heads, kv_heads, head_dim, block_size, layers in CASES:
        gen = torch.Generator().manual_seed(seqs * ctx)
        per_seq = -(-ctx // block_size)
        shape = (seqs * per_seq + 1, block_size, kv_heads, head_dim)
        caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(layers)]
        tables = (torch.randperm(seqs * per_seq, generator=gen) + 1).to(torch.int32).reshape(seqs, per_seq)
        lens = torch.full((seqs,), ctx, dtype=torch.int32)
        query = torch.randn(seqs, heads, head_dim, generator=gen)
        calls = max(1, 256 // (seqs * layers))  # enough work per timing for the tiny cases
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for rnd in range(args.rounds):
            for key in (list(kernels) if rnd % 2 == 0 else list(kernels)[::-1]):
                t0 = time.perf_counter()
                for _ in range(calls):
                    for k_cache, v_cache in caches:
                        kernels[key](query, k_cache, v_cache, tables, lens, head_dim**-0.5)
                times[key].append((time.perf_counter() - t0) / (calls * layers))
        flops, kv_bytes = 4 * seqs * ctx * heads * head_dim, 2 * seqs * ctx * kv_heads * head_dim * 4
        cells = []
        for key, ts in times.items():
            sec = statistics.median(ts)
            cells.append(f"{key} {flops / sec / 1e9:5.1f} GFLOP/s {kv_bytes / sec / 1e9:5.1f} GB/s")
        if "alt" in times:
            ratio = statistics.median([a / c for a, c in zip(times["alt"], times["current"], strict=True)])
            cells.append(f"alt/current x{ratio:.2f}")
        print(f"{name:28s} " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
