"""``python -m bench.mamba2_decode``: Granite 4's Mamba-2 decode step on the CPU, the C one-step
update (``kernels/cpu_mamba2.c``) against the torch reference, side by side in one run.

A Granite-4.0-H-Small-like Mamba-2 shape (128 heads of 64 features, 1 group, a 128-wide state) over a
batch of decode rows, each with its own state slot; one layer's scan only (no projections, no
conv). Prints the time of each and their ratio; the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.gated_delta_decode import _time


def main(argv: list[str] | None = None) -> None:
    from inflight.kernels import cpu_mamba2, mamba2_reference

    parser = argparse.ArgumentParser(prog="python -m bench.mamba2_decode")
    parser.add_argument("--rows", type=int, default=32, help="decode rows (sequences) in the step")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if cpu_mamba2.load_library()[0] is None:
        raise SystemExit(f"no C build: {cpu_mamba2.load_library()[1]}")
    n, heads, p, groups, d_state = args.rows, 128, 64, 1, 128
    gen = torch.Generator().manual_seed(0)
    x, dt = torch.randn(n, heads, p, generator=gen), F.softplus(torch.randn(n, heads, generator=gen))
    a, d = -torch.rand(heads, generator=gen), torch.rand(heads, generator=gen)
    b, c = torch.randn(n, groups, d_state, generator=gen), torch.randn(n, groups, d_state, generator=gen)
    state = torch.randn(n, heads, p, d_state, generator=gen) * 0.1
    rows = (torch.arange(n + 1, dtype=torch.int32), torch.arange(n), torch.ones(n, dtype=torch.bool))
    call = (x, dt, a, b, c, d, state, *rows)
    ref = _time(mamba2_reference.ssd_scan, call, args.reps)
    native = _time(cpu_mamba2.ssd_scan, call, args.reps)
    print(f"{n} decode rows x {heads} heads of {p}x{d_state} state, {torch.get_num_threads()} threads: "
          f"torch reference {ref * 1e3:.2f} ms, C {native * 1e3:.2f} ms, C is {ref / native:.1f}x faster")


if __name__ == "__main__":
    main()
