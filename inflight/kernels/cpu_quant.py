"""Native CPU kernels for GGUF block-quantized weights: builds ``cpu_quant.c`` like cpu_native.

:func:`quant_linear` and :func:`quant_embedding` have the signatures of
:mod:`inflight.kernels.quant_reference`. Few-row calls (decode and speculative verify: up to
:func:`few_rows` rows, ``FEW_ROWS_K`` for the K-quants) run the C kernel that unpacks each block
once (into registers, with AVX-512) and multiplies it into every activation row; many-row calls (prefill) dequantize
tiles of weight rows in C and multiply each tile with torch's GEMM. Q4_0/Q4_1/Q8_0 run ``cpu_quant.c``; the K-quants (Q4_K, Q5_K, Q6_K) run
``cpu_kquant.c`` (built by :mod:`inflight.kernels.cpu_kquant`), whose entry points have the
same signatures. Anything the C code does not take (other dtypes, other devices, no compiler)
goes to the reference. The library is compiled with cpu_native's compiler flags into the same
cache folder, keyed by this source. Knows nothing about models or GGUF files.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from inflight.kernels import cpu_kquant, cpu_native, quant_reference
from inflight.kernels.quant_reference import K_QUANTS, QTYPE_IDS, QuantizedWeight

SOURCE = Path(__file__).with_name("cpu_quant.c")
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "inflight_quant_dequantize_f32": (None, [_ptr, _int, _ptr, _i64, _i64, _int]),
    "inflight_quant_linear_f32": (ctypes.c_int, [_ptr, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "inflight_quant_few_rows": (ctypes.c_int, []),
}
# Above this many rows (the portable build's; the AVX-512 build says 8, see few_rows) a tile of
# dequantized weight rows times torch's GEMM wins over streaming the packed weight once per
# group of four rows: the tiles won 1.1-1.8x at 5-8 rows on 9 of 12 SmolLM2 shapes x threads
# for Q4_0/Q4_1/Q8_0 against the four-row kernel. The AVX-512 kernel takes eight rows a pass
# and won 1.3-2.2x over the tiles at 5 and 8 rows on every SmolLM2 shape at one thread
# (python -m bench.studies.quant_few_rows; bench/results/quant_few_rows.md).
FEW_ROWS = 4
# K-quants unpack a sub-block per four rows, and the tiles dequantize fast: the fused kernel won
# 1.05-1.9x at 1-4 rows and lost 1.3-1.5x at 8 (576x1536 and 1536x768, 1 and 2 threads).
FEW_ROWS_K = 4
TILE_ROWS = 256  # weight rows dequantized per GEMM in the many-row path
# A weight whose float copy is at most this big is dequantized whole for one GEMM (no tile
# loop, no strided writes: 1.2-1.5x faster than tiles at 16-64 rows on SmolLM2's layer
# shapes); bigger ones (an LM head: 108 MiB as float32) go by tiles to bound the scratch.
WHOLE_WEIGHT_BYTES = 8 << 20


@lru_cache(maxsize=1)
def load_library() -> tuple[ctypes.CDLL | None, str]:
    """The loaded kernels and where they came from, or ``(None, why not)``."""
    return cpu_native.compile_library(SOURCE, "cpu_quant", _SIGNATURES)


@lru_cache(maxsize=1)
def few_rows() -> int:
    """The most activation rows the fused Q4_0/Q4_1/Q8_0 kernel takes (its build decides: 8 with
    AVX-512, else :data:`FEW_ROWS`); above it :func:`quant_linear` dequantizes tiles for a GEMM."""
    lib = load_library()[0]
    return FEW_ROWS if lib is None else max(FEW_ROWS, int(lib.inflight_quant_few_rows()))


def _kernels(qtype: str) -> tuple[Callable[..., None], Callable[..., int]] | None:
    """The C ``(dequantize, linear)`` entry points for ``qtype``, or None when its library does not build."""
    if qtype in K_QUANTS:
        lib = cpu_kquant.load_library()[0]
        return None if lib is None else (lib.inflight_kquant_dequantize_f32, lib.inflight_kquant_linear_f32)
    lib = load_library()[0]
    return None if lib is None else (lib.inflight_quant_dequantize_f32, lib.inflight_quant_linear_f32)


def _native_ok(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and weight.blocks.device.type == "cpu"
            and weight.blocks.is_contiguous() and _kernels(weight.qtype) is not None)


def dequantize_rows(weight: QuantizedWeight, start: int, end: int) -> torch.Tensor:  # [end - start, in]
    """Weight rows ``start:end`` as float32, in C when the library builds."""
    kernels = _kernels(weight.qtype)
    rows = weight.blocks[start:end]
    if kernels is None or weight.blocks.device.type != "cpu":
        return quant_reference.dequantize_blocks(weight.qtype, rows, weight.in_features)
    rows = rows.contiguous()
    out = torch.empty((rows.shape[0], weight.in_features), dtype=torch.float32)
    kernels[0](rows.data_ptr(), QTYPE_IDS[weight.qtype], out.data_ptr(), rows.shape[0], weight.in_features,
               torch.get_num_threads())
    return out


def quant_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    if x.dim() != 2 or not _native_ok(x, weight) or (bias is not None and bias.dtype != torch.float32):
        return quant_reference.quant_linear(x, weight, bias)
    x = x.contiguous()
    num_rows, out_features = x.shape[0], weight.shape[0]
    if num_rows > (FEW_ROWS_K if weight.qtype in K_QUANTS else few_rows()):
        if out_features * weight.in_features * 4 <= WHOLE_WEIGHT_BYTES:
            out = x @ dequantize_rows(weight, 0, out_features).t()
            return out if bias is None else out.add_(bias)
        out = torch.empty((num_rows, out_features), dtype=torch.float32)
        for start in range(0, out_features, TILE_ROWS):
            end = min(start + TILE_ROWS, out_features)
            out[:, start:end] = x @ dequantize_rows(weight, start, end).t()
        return out if bias is None else out.add_(bias)
    bias = None if bias is None else bias.contiguous()
    out = torch.empty((num_rows, out_features), dtype=torch.float32)
    kernels = _kernels(weight.qtype)
    assert kernels is not None  # _native_ok checked it
    status = kernels[1](
        x.data_ptr(), weight.blocks.data_ptr(), QTYPE_IDS[weight.qtype],
        None if bias is None else bias.data_ptr(), out.data_ptr(), num_rows, out_features,
        weight.in_features, torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("quant_linear: no memory for the activation block sums")
    return out


def quant_embedding(ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:  # [num_ids, in_features]
    rows = weight.blocks[ids.reshape(-1)]
    return dequantize_rows(QuantizedWeight(weight.qtype, rows, weight.in_features), 0, rows.shape[0])
