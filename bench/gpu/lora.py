"""The multi-LoRA delta's timing table for the GPU kernel bench (:mod:`bench.gpu.kernels`).

For a q-projection-sized layer (4096 -> 4096, bf16) with 8 rank-16 adapters and the rows
spread round-robin over them, prints the Triton kernel's time, the torch reference's (rows
grouped by slot, host-synchronizing) and the base projection's GEMM, for decode-sized to
prefill-sized batches: the LoRA delta's cost is read as a fraction of the base GEMM it rides
on. Owns only the measurement; the kernels are imported, never re-implemented. Correctness
is :func:`bench.gpu.checks._check_lora`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bench.gpu.timing import median_ms

NUM_TOKENS = (1, 16, 64, 256, 1024, 4096)


@dataclass(frozen=True, slots=True)
class LoraShape:
    in_features: int = 4096
    out_features: int = 4096
    rank: int = 16
    num_adapters: int = 8
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"  # the CPU (interpreter) only in the dry run


def time_lora(
    num_tokens: int, shape: LoraShape, timer: Callable[[Callable[[], object]], float]
) -> dict[str, float]:
    """ms per call of the Triton delta, the reference delta and the base GEMM."""
    from inflight.kernels import lora_reference
    from inflight.kernels.triton_lora import lora_delta

    dev, dtype = shape.device, shape.dtype
    x = torch.randn(num_tokens, shape.in_features, device=dev, dtype=dtype)
    weight = torch.randn(shape.out_features, shape.in_features, device=dev, dtype=dtype) * 0.02
    a = torch.randn(shape.num_adapters, shape.rank, shape.in_features, device=dev, dtype=dtype) * 0.02
    b = torch.randn(shape.num_adapters, shape.out_features, shape.rank, device=dev, dtype=dtype) * 0.02
    slots = (torch.arange(num_tokens, device=dev) % shape.num_adapters).int()
    out = torch.zeros(num_tokens, shape.out_features, device=dev, dtype=dtype)
    return {
        "triton_ms": timer(lambda: lora_delta(x, a, b, slots, out)),
        "reference_ms": timer(lambda: lora_reference.lora_delta(x, a, b, slots, out)),
        "base_ms": timer(lambda: F.linear(x, weight)),
    }


def lora_table(
    shape: LoraShape = LoraShape(),
    num_tokens: tuple[int, ...] = NUM_TOKENS,
    timer: Callable[[Callable[[], object]], float] = median_ms,
) -> list[dict[str, object]]:
    """Print (and return) one row per batch size; a point that raises is a row with its error."""
    print(
        f"\nMulti-LoRA delta, {shape.in_features} -> {shape.out_features}, {shape.num_adapters} adapters "
        f"of rank {shape.rank} round-robin over the rows, {str(shape.dtype)[6:]}"
    )
    print(f"{'tokens':>7} {'triton us':>10} {'reference us':>13} {'base GEMM us':>13} {'triton/base':>12} "
          f"{'ref/triton':>11}")  # fmt: skip
    rows: list[dict[str, object]] = []
    for n in num_tokens:
        try:
            t = time_lora(n, shape, timer)
        except Exception as exc:  # one point's failure is its row; the table goes on
            error = f"{type(exc).__name__}: {exc}"[:300]
            rows.append({"num_tokens": n, "error": error})
            print(f"{n:>7} FAILED: {error}")
            continue
        rows.append({"num_tokens": n, **t})
        print(f"{n:>7} {t['triton_ms'] * 1e3:>10.1f} {t['reference_ms'] * 1e3:>13.1f} {t['base_ms'] * 1e3:>13.1f} "
              f"{t['triton_ms'] / t['base_ms']:>12.2f} {t['reference_ms'] / t['triton_ms']:>11.2f}")  # fmt: skip
    return rows
