"""``python -m bench.gated_delta_decode``: Qwen3-Next's linear-attention decode step on the CPU, the
C one-token step (``kernels/cpu_gated_delta.c``) against the torch reference, side by side in one run.

Qwen3-Next-80B's linear-layer shape (16 key heads, 32 value heads, 128 x 128 state per head) over
a batch of decode rows, each with its own state slot; one layer's rule only (no projections, no
conv). Prints the time of each and their ratio; the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def _time(fn: Callable[..., torch.Tensor], args: tuple, reps: int) -> float:
    fn(*args)  # warm-up (and the C build)
    start = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    return (time.perf_counter() - start) / reps


def main(argv: list[str] | None = None) -> None:
    from inflight.kernels import cpu_gated_delta, gated_delta

    parser = argparse.ArgumentParser(prog="python -m bench.gated_delta_decode")
    parser.add_argument("--rows", type=int, default=32, help="decode rows (sequences) in the step")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if cpu_gated_delta.load_library()[0] is None:
        raise SystemExit(f"no C build: {cpu_gated_delta.load_library()[1]}")
    n, hk, hv, d = args.rows, 16, 32, 128
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(n, hk, d, generator=gen), torch.randn(n, hk, d, generator=gen)
    v, g, beta = torch.randn(n, hv, d, generator=gen), -torch.rand(n, hv, generator=gen), torch.rand(n, hv)
    state = torch.randn(n, hv, d, d, generator=gen) * 0.1
    rows = (torch.arange(n + 1, dtype=torch.int32), torch.arange(n), torch.ones(n, dtype=torch.bool))
    call = (q, k, v, g, beta, state, *rows)
    ref = _time(gated_delta.gated_delta_rule, call, args.reps)
    native = _time(cpu_gated_delta.gated_delta_rule, call, args.reps)
    print(f"{n} decode rows x {hv} value heads of {d}x{d} state, {torch.get_num_threads()} threads: "
          f"torch reference {ref * 1e3:.2f} ms, C {native * 1e3:.2f} ms, C is {ref / native:.1f}x faster")


if __name__ == "__main__":
    main()
