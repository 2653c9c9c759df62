"""Native CPU kernels for compressed-tensors pack-quantized weights: builds ``cpu_intq.c`` like cpu_native.

:func:`intq_linear` has the signature of :func:`inflight.kernels.intq_reference.intq_linear`.
Few-row calls (decode) run the C kernel that reads the packed int32 words, scales and zero
points directly, unpacking 8 weights at a time in registers and dotting them with up to four
activation rows; many-row calls (prefill) dequantize tiles of weight rows in C (bit-identical
to the reference) and multiply each tile with torch's GEMM. Anything the C code does not take
(activations other than float32, other devices, groups that are not a multiple of 8 wide, no
compiler) goes to the reference. The library is compiled with cpu_native's compiler flags into
the same cache folder, keyed by this source. Knows nothing about models or checkpoints.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch

from inflight.kernels import cpu_native, intq_reference
from inflight.kernels.intq_reference import IntQuantWeight

SOURCE = Path(__file__).with_name("cpu_intq.c")
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "inflight_intq_dequantize_f32": (None, [_ptr, _ptr, _int, _ptr, _int, _ptr, _i64, _i64, _i64, _int]),
    "inflight_intq_linear_f32": (None, [_ptr, _ptr, _ptr, _int, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64, _i64, _int]),
}
SCALE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the C kernels' codes
# Above this many rows a tile of dequantized weight rows times torch's GEMM wins over
# streaming the packed weight once per four rows.
FEW_ROWS = 8
TILE_ROWS = 256  # weight rows dequantized per GEMM in the many-row path


@lru_cache(maxsize=1)
def load_library() -> tuple[ctypes.CDLL | None, str]:
    """The loaded kernels and where they came from, or ``(None, why not)``."""
    return cpu_native.compile_library(SOURCE, "cpu_intq", _SIGNATURES)


def _weight_ok(weight: IntQuantWeight) -> bool:
    tensors = [weight.weight_packed, weight.weight_scale]
    if weight.weight_zero_point is not None:
        tensors.append(weight.weight_zero_point)
    aligned = weight.group_size % 8 == 0 or weight.num_groups == 1
    return aligned and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def _native_ok(x: torch.Tensor, weight: IntQuantWeight) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and _weight_ok(weight)
            and load_library()[0] is not None)


def _zp_ptr(weight: IntQuantWeight) -> int | None:
    return None if weight.weight_zero_point is None else weight.weight_zero_point.data_ptr()


def dequantize_rows(weight: IntQuantWeight, start: int, end: int) -> torch.Tensor:  # [end - start, in] float32
    """Weight rows ``start:end`` as float32 (values of the scale's dtype), in C when it builds."""
    lib = load_library()[0]
    if lib is None or not _weight_ok(weight):
        rows = IntQuantWeight(weight.weight_packed[start:end], weight.weight_scale[start:end], weight.in_features,
                              weight.num_bits, weight.group_size,
                              None if weight.symmetric else weight.weight_zero_point[start:end])
        return intq_reference.dequantize(rows).float()
    groups = weight.num_groups
    out = torch.empty((end - start, weight.in_features), dtype=torch.float32)
    zp = _zp_ptr(weight)
    lib.inflight_intq_dequantize_f32(
        weight.weight_packed.data_ptr() + start * weight.weight_packed.shape[1] * 4,
        weight.weight_scale.data_ptr() + start * groups * weight.weight_scale.element_size(),
        SCALE_CODES[weight.weight_scale.dtype], None if zp is None else zp + start * groups,
        weight.num_bits, out.data_ptr(), end - start, weight.in_features, weight.group_size,
        torch.get_num_threads(),
    )
    return out


def intq_linear(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: IntQuantWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    if x.dim() != 2 or not _native_ok(x, weight) or (bias is not None and bias.dtype != torch.float32):
        return intq_reference.intq_linear(x, weight, bias)
    x = x.contiguous()
    num_rows, out_features = x.shape[0], weight.shape[0]
    out = torch.empty((num_rows, out_features), dtype=torch.float32)
    if num_rows > FEW_ROWS:
        for start in range(0, out_features, TILE_ROWS):
            end = min(start + TILE_ROWS, out_features)
            out[:, start:end] = x @ dequantize_rows(weight, start, end).t()
        return out if bias is None else out.add_(bias)
    bias = None if bias is None else bias.contiguous()
    load_library()[0].inflight_intq_linear_f32(
        x.data_ptr(), weight.weight_packed.data_ptr(), weight.weight_scale.data_ptr(),
        SCALE_CODES[weight.weight_scale.dtype], _zp_ptr(weight), weight.num_bits,
        None if bias is None else bias.data_ptr(), out.data_ptr(), num_rows, out_features,
        weight.in_features, weight.group_size, torch.get_num_threads(),
    )
    return out
