"""Native CPU kernels for GGUF block-quantized weights: builds ``cpu_quant.c`` like cpu_native.

:func:`quant_linear` and :func:`quant_embedding` have the signatures of
:mod:`inflight.kernels.quant_reference`. Few-row calls (decode) run the C kernel that
unpacks each block once into 32 scaled floats and dots it with up to four activation rows;
many-row calls (prefill) dequantize tiles of weight rows in C and multiply each tile with
torch's GEMM. Anything the C code does not take (other dtypes, other devices, no compiler)
goes to the reference. The library is compiled with cpu_native's compiler flags into the same
cache folder, keyed by this source. Knows nothing about models or GGUF files.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from inflight.kernels import cpu_native, quant_reference
from inflight.kernels.quant_reference import QTYPE_IDS, QuantizedWeight

SOURCE = Path(__file__).with_name("cpu_quant.c")
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "inflight_quant_dequantize_f32": (None, [_ptr, _int, _ptr, _i64, _i64, _int]),
    "inflight_quant_linear_f32": (ctypes.c_int, [_ptr, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64, _int]),
}
# Above this many rows a tile of dequantized weight rows times torch's GEMM wins over
# streaming the packed weight once per row group.
FEW_ROWS = 8
TILE_ROWS = 256  # weight rows dequantized per GEMM in the many-row path


@lru_cache(maxsize=1)
def load_library() -> tuple[ctypes.CDLL | None, str]:
    """The loaded kernels and where they came from, or ``(None, why not)``."""
    return cpu_native.compile_library(SOURCE, "cpu_quant", _SIGNATURES)


def _native_ok(x: torch.Tensor, weight: QuantizedWeight) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and weight.blocks.device.type == "cpu"
            and weight.blocks.is_contiguous() and load_library()[0] is not None)


def dequantize_rows(weight: QuantizedWeight, start: int, end: int) -> torch.Tensor:  # [end - start, in]
    """Weight rows ``start:end`` as float32, in C when the library builds."""
    lib = load_library()[0]
    rows = weight.blocks[start:end]
    if lib is None or weight.blocks.device.type != "cpu":
        return quant_reference.dequantize_blocks(weight.qtype, rows, weight.in_features)
    rows = rows.contiguous()
    out = torch.empty((rows.shape[0], weight.in_features), dtype=torch.float32)
    lib.inflight_quant_dequantize_f32(rows.data_ptr(), QTYPE_IDS[weight.qtype], out.data_ptr(),
                                      rows.shape[0], weight.in_features, torch.get_num_threads())
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
    if num_rows > FEW_ROWS:
        out = torch.empty((num_rows, out_features), dtype=torch.float32)
        for start in range(0, out_features, TILE_ROWS):
            end = min(start + TILE_ROWS, out_features)
            out[:, start:end] = x @ dequantize_rows(weight, start, end).t()
        return out if bias is None else out.add_(bias)
    bias = None if bias is None else bias.contiguous()
    out = torch.empty((num_rows, out_features), dtype=torch.float32)
    status = load_library()[0].inflight_quant_linear_f32(
        x.data_ptr(), weight.blocks.data_ptr(), QTYPE_IDS[weight.qtype],
        None if bias is None else bias.data_ptr(), out.data_ptr(), num_rows, out_features,
        weight.in_features, torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("quant_linear: no memory for the per-thread row buffer")
    return out


def quant_embedding(ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:  # [num_ids, in_features]
    rows = weight.blocks[ids.reshape(-1)]
    return dequantize_rows(QuantizedWeight(weight.qtype, rows, weight.in_features), 0, rows.shape[0])
