"""``python -m bench.studies.quant_few_rows``: the fused few-row GGUF linear (``cpu_quant.c``) at 1-8
activation rows on SmolLM2-135M's shapes, builds of it side by side, and what an extra row costs.

A speculative verify step multiplies ``k + 1`` rows (k drafts and the last accepted token) by every
weight where a plain decode multiplies one; how much dearer that step is decides whether speculation
pays. This study builds ``cpu_quant.c`` twice (as the engine builds it, ``-march=native``, and with
``-mno-avx512f``: the portable AVX2 path), optionally a third source (``--before FILE``: e.g. an
earlier revision, ``git show REV:inflight/kernels/cpu_quant.c > FILE``), and times each build's
``inflight_quant_linear_f32`` and the many-row path (dequantized tiles times torch's GEMM, what
:func:`inflight.kernels.cpu_quant.quant_linear` runs above ``FEW_ROWS``) at each row count and thread
count. The variants run interleaved, one block of calls each per round, so a shared machine's noise
hits them alike; each figure is the median over rounds of ms per call, and ``xN`` is the cost at N
rows over the same variant's cost at 1 row. Weights are made by ``gguf.quants.quantize`` from seeded
random floats (SmolLM2 serves its layers Q4_1 and its tied vocab head Q8_0). A benchmark: it asserts
nothing; the numbers belong to the machine they were taken on.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from inflight.kernels import cpu_native, cpu_quant
from inflight.kernels.quant_reference import QTYPE_IDS, QuantizedWeight

# (name, out_features, in_features, qtype): one SmolLM2-135M layer's products and the vocab head.
SHAPES = (
    ("q/o", 576, 576, "Q4_1"),
    ("k/v", 192, 576, "Q4_1"),
    ("gate/up", 1536, 576, "Q4_1"),
    ("down", 576, 1536, "Q4_1"),
    ("head", 49152, 576, "Q8_0"),
)
# How many of each shape one decode step runs (30 layers: q, k, v, o, gate, up, down; one head).
PER_STEP = {"q/o": 60, "k/v": 60, "gate/up": 60, "down": 30, "head": 1}


def _build(source: Path, stem: str, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    """``source`` built beside copies of the kernels' headers (cpu_native keys the cache by both)."""
    with tempfile.TemporaryDirectory() as tmp:
        for header in cpu_quant.SOURCE.parent.glob("*.h"):
            shutil.copy(header, tmp)
        copy = Path(tmp) / "cpu_quant.c"
        shutil.copy(source, copy)
        lib, where = cpu_native.compile_library(copy, stem, {
            "inflight_quant_linear_f32": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int]),
        }, extra_flags=extra_flags)
    if lib is None:
        raise RuntimeError(f"cannot build {source} ({' '.join(extra_flags) or 'native'}): {where}")
    return lib


def _weight(qtype: str, out_features: int, in_features: int) -> QuantizedWeight:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(out_features * 7 + in_features)
    w = (rng.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    blocks = np.ascontiguousarray(quantize(w, GGMLQuantizationType[qtype]))
    return QuantizedWeight(qtype, torch.from_numpy(blocks), in_features)


def _fused(lib: ctypes.CDLL, x: torch.Tensor, weight: QuantizedWeight) -> Callable[[], object]:
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)

    def call() -> object:
        return lib.inflight_quant_linear_f32(x.data_ptr(), weight.blocks.data_ptr(), QTYPE_IDS[weight.qtype], None,
                                             out.data_ptr(), x.shape[0], weight.shape[0], weight.in_features,
                                             torch.get_num_threads())
    return call


def _tiles(x: torch.Tensor, weight: QuantizedWeight) -> Callable[[], object]:
    def call() -> object:  # quant_linear's many-row path, whatever FEW_ROWS says
        if weight.shape[0] * weight.in_features * 4 <= cpu_quant.WHOLE_WEIGHT_BYTES:
            return x @ cpu_quant.dequantize_rows(weight, 0, weight.shape[0]).t()
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
        for start in range(0, weight.shape[0], cpu_quant.TILE_ROWS):
            end = min(start + cpu_quant.TILE_ROWS, weight.shape[0])
            out[:, start:end] = x @ cpu_quant.dequantize_rows(weight, start, end).t()
        return out
    return call


def measure(calls: dict[str, Callable[[], object]], rounds: int, block_ms: float) -> dict[str, float]:
    """Median ms per call of each callable, interleaved one block of calls each per round."""
    per_block: dict[str, int] = {}
    for name, fn in calls.items():
        fn()
        start = time.perf_counter()
        fn()
        per_block[name] = max(3, int(block_ms / 1e3 / max(time.perf_counter() - start, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(per_block[name]):
                fn()
            times[name].append((time.perf_counter() - start) / per_block[name] * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per case")
    parser.add_argument("--block-ms", type=float, default=15.0, help="time per variant per round")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8])
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], help="a subset of the shape names")
    parser.add_argument("--before", type=Path, help="another cpu_quant.c to build and time beside this one")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.block_ms <= 0 or min(args.rows) < 1:
        raise ValueError("--rounds and --rows must be >= 1 and --block-ms > 0.")
    builds = {"native": _build(cpu_quant.SOURCE, "bench_quant_native", ()),
              "avx2": _build(cpu_quant.SOURCE, "bench_quant_avx2", ("-mno-avx512f",))}
    if args.before is not None:
        builds = {"before": _build(args.before, "bench_quant_before", ()), **builds}
    variants = [*builds, "tiles"]
    print(f"ms per call, median of {args.rounds} interleaved rounds; xN = cost at N rows / the same variant at 1 row")
    print(f"{'shape':>8} {'thr':>3} {'rows':>4} " + " ".join(f"{v:>16}" for v in variants))
    results: list[dict[str, object]] = []
    step: dict[tuple[str, int, int], float] = {}
    for name, out_features, in_features, qtype in (s for s in SHAPES if s[0] in args.shapes):
        weight = _weight(qtype, out_features, in_features)
        for threads in args.threads:
            torch.set_num_threads(threads)
            one: dict[str, float] = {}
            for rows in sorted(set(args.rows) | {1}):
                x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
                calls = {b: _fused(lib, x, weight) for b, lib in builds.items()} | {"tiles": _tiles(x, weight)}
                ms = measure(calls, args.rounds, args.block_ms)
                one = one or dict(ms)
                for v in variants:
                    step[(v, threads, rows)] = step.get((v, threads, rows), 0.0) + ms[v] * PER_STEP[name]
                results.append({"shape": name, "qtype": qtype, "threads": threads, "rows": rows, "ms": ms})
                print(f"{name:>8} {threads:>3} {rows:>4} "
                      + " ".join(f"{ms[v]:>8.4f} (x{ms[v] / one[v]:.2f})" for v in variants), flush=True)
    print("\none decode step's linears (30 layers + head), ms; xN against the same variant at 1 row")
    for threads in args.threads:
        for rows in sorted(set(args.rows) | {1}):
            print(f"{'step':>8} {threads:>3} {rows:>4} " + " ".join(
                f"{step[(v, threads, rows)]:>8.2f} (x{step[(v, threads, rows)] / step[(v, threads, 1)]:.2f})"
                for v in variants))
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "step": [
            {"variant": v, "threads": t, "rows": r, "ms": ms} for (v, t, r), ms in step.items()]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
