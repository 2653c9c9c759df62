"""Decode-sized linears on GGUF blocks: float32 vs the unpack-to-float kernel vs the integer-dot kernel.

    python -m bench.studies.quant_dot [--rounds 5] [--block-ms 20] [--threads 1 2] [--rows 1 4 8]

On SmolLM2-135M's shapes (fused q/k/v 960x576, o 576x576, gate and up 1536x576, down
576x1536 in Q4_1 and Q8_0; the tied vocab head 49152x576 in Q8_0), with weights made by
``gguf.quants.quantize`` from seeded random floats, prints milliseconds per call of
``F.linear`` on the float32 weight, cpu_native's float32 ``linear`` (what the float engine runs
at decode), :func:`inflight.kernels.cpu_quant.quant_linear` (unpack each block to floats) and
:func:`inflight.kernels.cpu_quant_q8.quant_linear_q8` (8-bit activation, integer dots), at 1, 4
and 8 rows and 1 and 2 threads. The kernels run interleaved, one block of calls each per round,
so a noisy shared machine hurts all of them alike; each figure is ``median [min-max]`` over the
rounds, and the ratios are taken within a round. Nothing is asserted; the numbers belong to the
machine they were taken on. Knows nothing about models beyond the shapes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from inflight.kernels import cpu_native, cpu_quant, cpu_quant_q8
from inflight.kernels.quant_reference import QuantizedWeight

HIDDEN, INTERMEDIATE, VOCAB = 576, 1536, 49152
# (name, out_features, in_features, qtypes)
SHAPES = (
    ("qkv", HIDDEN + 2 * 192, HIDDEN, ("Q4_1", "Q8_0")),
    ("o", HIDDEN, HIDDEN, ("Q4_1", "Q8_0")),
    ("gate/up", INTERMEDIATE, HIDDEN, ("Q4_1", "Q8_0")),
    ("down", HIDDEN, INTERMEDIATE, ("Q4_1", "Q8_0")),
    ("head", VOCAB, HIDDEN, ("Q8_0",)),
)
KERNELS = ("F.linear", "f32-native", "quant", "quant-q8")


def _weights(qtype: str, out_features: int, in_features: int) -> tuple[torch.Tensor, QuantizedWeight]:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(out_features * 7 + in_features)
    w = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    blocks = np.ascontiguousarray(quantize(w, GGMLQuantizationType[qtype]))
    return torch.from_numpy(w), QuantizedWeight(qtype, torch.from_numpy(blocks), in_features)


def _calls_per_block(fn: Callable[[], object], block_ms: float) -> int:
    fn()
    start = time.perf_counter()
    fn()
    one = max(time.perf_counter() - start, 1e-6)
    return max(3, int(block_ms / 1e3 / one))


def _ms_per_call(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def measure(kernels: dict[str, Callable[[], object]], rounds: int, block_ms: float) -> dict[str, list[float]]:
    """ms per call of each kernel, one figure per round; the kernels interleaved within a round."""
    calls = {name: _calls_per_block(fn, block_ms) for name, fn in kernels.items()}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, fn in kernels.items():
            times[name].append(_ms_per_call(fn, calls[name]))
    return times


def _span(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def _kernels(x: torch.Tensor, dense: torch.Tensor, packed: QuantizedWeight) -> dict[str, Callable[[], object]]:
    return {
        "F.linear": lambda: F.linear(x, dense),
        "f32-native": lambda: cpu_native.linear(x, dense),
        "quant": lambda: cpu_quant.quant_linear(x, packed),
        "quant-q8": lambda: cpu_quant_q8.quant_linear_q8(x, packed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per case")
    parser.add_argument("--block-ms", type=float, default=20.0, help="time per kernel per round")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], help="a subset of the shape names")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.block_ms <= 0:
        raise ValueError("--rounds must be >= 1 and --block-ms > 0.")
    print(f"q8 paths in this build: {', '.join(cpu_quant_q8.available_paths()) or 'none (reference)'}; "
          f"ms per call, median [min-max] over {args.rounds} interleaved rounds; ratio = other / quant-q8")
    print(f"{'shape':>8} {'qtype':>5} {'thr':>3} {'rows':>4} "
          + " ".join(f"{k:>22}" for k in KERNELS) + f" {'F.linear/q8':>18} {'native/q8':>18} {'quant/q8':>18}")
    for name, out_features, in_features, qtypes in SHAPES:
        if name not in args.shapes:
            continue
        for qtype in qtypes:
            dense, packed = _weights(qtype, out_features, in_features)
            for threads in args.threads:
                torch.set_num_threads(threads)
                for rows in args.rows:
                    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
                    t = measure(_kernels(x, dense, packed), args.rounds, args.block_ms)
                    ratios = [[a / b for a, b in zip(t[k], t["quant-q8"], strict=True)]
                              for k in ("F.linear", "f32-native", "quant")]
                    print(f"{name:>8} {qtype:>5} {threads:>3} {rows:>4} "
                          + " ".join(f"{_span(t[k]):>22}" for k in KERNELS)
                          + " " + " ".join(f"{_span(r, 2):>18}" for r in ratios), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
