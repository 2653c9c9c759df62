"""Integer-dot decode kernel for GGUF Q4_0/Q4_1/Q8_0 weights: builds ``cpu_quant_q8.c`` like cpu_quant.

:func:`quant_linear_q8` has the signature of :func:`inflight.kernels.quant_reference.quant_linear`
but not quite its numbers: each call quantizes the activation rows once to 8-bit blocks
(per 32 values ``d = amax / 127``, ``q = round(x / d)``, as llama.cpp's Q8_0/Q8_1 do) and dots
them in integers with the packed weight blocks, one float multiply-add per block. Its
specification is :func:`quant_q8_reference` (the same 8-bit activation, then dequantized
float math), which is also the fallback for anything the C code does not take (other dtypes
or devices, no compiler). Against the float reference the error is bounded by the activation
rounding: ``|y - y_ref| <= sum over blocks of amax_b / 254 * sum |w_b|`` (plus float rounding).
Meant for few rows (decode); it runs any number but rounds every row's activation.

The library is compiled with cpu_native's flags (``-march=native``) into the same cache. Knows
nothing about models, GGUF files or which kernel the dispatcher picks.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from inflight.kernels import cpu_native, quant_reference
from inflight.kernels.quant_reference import BLOCK_SIZE, QTYPE_IDS, QuantizedWeight

SOURCE = Path(__file__).with_name("cpu_quant_q8.c")
PATHS = ("scalar", "avx2", "vnni")  # the C code's path codes 0, 1, 2
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "inflight_q8_paths": (_int, []),
    "inflight_q8_quantize_f32": (_int, [_ptr, _i64, _i64, _int, _ptr, _ptr, _ptr]),
    "inflight_q8_linear_f32": (_int, [_ptr, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64, _int, _int]),
}


@lru_cache(maxsize=1)
def load_library() -> tuple[ctypes.CDLL | None, str]:
    """The loaded kernels and where they came from, or ``(None, why not)``."""
    return cpu_native.compile_library(SOURCE, "cpu_quant_q8", _SIGNATURES, ("-lm",))


@lru_cache(maxsize=1)
def available_paths() -> tuple[str, ...]:
    """The paths compiled into this machine's build, slowest first (``()`` without a build)."""
    lib = load_library()[0]
    if lib is None:
        return ()
    mask = lib.inflight_q8_paths()
    return tuple(name for code, name in enumerate(PATHS) if mask >> code & 1)


def _path_code(path: str) -> int:
    paths = available_paths()
    if path == "auto":
        return PATHS.index(paths[-1])
    if path not in paths:
        raise ValueError(f"path {path!r} is not in this build; available: {', '.join(paths) or 'none'}.")
    return PATHS.index(path)


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, in]`` float32 -> ``(q [rows, in] int8, d [rows, in / 32] float32)``, in torch:
    ``d = amax / 127`` per 32 values, ``q = round_half_even(x * (1 / d))``, 0 where ``d = 0``."""
    rows, in_features = x.shape
    xb = x.float().reshape(rows, in_features // BLOCK_SIZE, BLOCK_SIZE)
    d = xb.abs().amax(dim=-1) / 127.0  # [rows, nb]
    inv = torch.where(d > 0, d.reciprocal(), torch.zeros_like(d))
    q = torch.round(xb * inv.unsqueeze(-1)).to(torch.int8)
    return q.reshape(rows, in_features), d


def quantize_activation_native(x: torch.Tensor, path: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_activation` done by the C code on ``path`` (for the tests)."""
    lib = load_library()[0]
    if lib is None:
        raise RuntimeError(f"cpu_quant_q8 is not built: {load_library()[1]}")
    x = x.contiguous()
    rows, in_features = x.shape
    q = torch.empty((rows, in_features), dtype=torch.int8)
    d = torch.empty((rows, in_features // BLOCK_SIZE), dtype=torch.float32)
    s = torch.empty_like(d)
    if lib.inflight_q8_quantize_f32(x.data_ptr(), rows, in_features, _path_code(path),
                                    q.data_ptr(), d.data_ptr(), s.data_ptr()) != 0:
        raise MemoryError("quantize_activation_native: no memory for scratch")
    return q, d


Q8_WEIGHT_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # 32-weight blocks; the K-quants have no integer path yet


def _check(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    if weight.qtype not in Q8_WEIGHT_TYPES:
        raise ValueError(f"integer dot products take {', '.join(Q8_WEIGHT_TYPES)} weights (got {weight.qtype}).")
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [num_rows, {weight.in_features}] (got {tuple(x.shape)}).")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}] (got {tuple(bias.shape)}).")


def quant_q8_reference(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
) -> torch.Tensor:  # [num_rows, out_features]
    """The kernel's specification: ``x`` rounded to 8-bit blocks, then the dequantized dot."""
    _check(x, weight, bias)
    q, d = quantize_activation(x)
    x8 = (q.float().reshape(x.shape[0], -1, BLOCK_SIZE) * d.unsqueeze(-1)).reshape(x.shape)
    out = F.linear(x8, quant_reference.dequantize(weight), None if bias is None else bias.float())
    return out.to(x.dtype)


def quant_linear_q8(
    x: torch.Tensor,  # [num_rows, in_features]
    weight: QuantizedWeight,
    bias: torch.Tensor | None = None,  # [out_features]
    *,
    path: str = "auto",
) -> torch.Tensor:  # [num_rows, out_features]
    """``x @ dequant(weight).T + bias`` with ``x`` rounded to 8-bit blocks once per call and
    integer dot products per block; ``path`` forces one compiled path (tests)."""
    _check(x, weight, bias)
    lib = load_library()[0]
    if (lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or weight.blocks.device.type != "cpu"
            or not weight.blocks.is_contiguous() or (bias is not None and bias.dtype != torch.float32)):
        return quant_q8_reference(x, weight, bias)
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    num_rows, out_features = x.shape[0], weight.shape[0]
    out = torch.empty((num_rows, out_features), dtype=torch.float32)
    if num_rows == 0:
        return out
    status = lib.inflight_q8_linear_f32(
        x.data_ptr(), weight.blocks.data_ptr(), QTYPE_IDS[weight.qtype],
        None if bias is None else bias.data_ptr(), out.data_ptr(), num_rows, out_features,
        weight.in_features, torch.get_num_threads(), _path_code(path),
    )
    if status != 0:
        raise MemoryError("quant_linear_q8: no memory for the quantized activation")
    return out
