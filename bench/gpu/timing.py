"""Timers, the device copy bandwidth and the engine-step targets shared by the GPU bench steps.

A leaf: ``kernels`` and ``engine`` both import it and never each other. Knows no kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ENGINE_TARGETS = {1: 2.0, 64: 1.5}  # decode step within this many x its roofline (with graphs)


def median_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (``triton.testing.do_bench``: warm-up, L2 flushed)."""
    import triton.testing

    return triton.testing.do_bench(fn, return_mode="median")


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def wall_median_ms(fn: Callable[[], object], reps: int = 5) -> float:
    """Median wall-clock milliseconds of ``fn`` (the CPU dry run's timer)."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
