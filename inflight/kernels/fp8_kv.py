"""The fp8 KV-cache formats: names, the quantize/dequantize every backend must agree with, and
the bit layouts the native and Triton kernels decode.

An fp8 cache holds ``clamp(x * (1 / scale), -max, max)`` rounded to nearest-even in
``torch.float8_e4m3fn`` (vLLM's ``fp8`` / ``fp8_e4m3``: 4 exponent bits, bias 7, 3 mantissa
bits, max 448, no infinities) or ``torch.float8_e5m2`` (``fp8_e5m2``: 5 exponent bits, bias 15,
2 mantissa bits, max 57344); a read is ``stored * scale``. ``scale`` is per tensor and per layer
(one for K, one for V): a python float or a 0-d tensor; ``None`` means 1.0 for an fp8 cache and
"no scaling" for a float one (a float cache is never scaled). Knows nothing about the model or
the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's --kv-cache-dtype names of the narrow formats ("auto" is the serving dtype): the fp8 ones,
# and bfloat16, a float32 engine's cache at half the bytes (cpu_bf16_kv.py; no scale).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
}

Scale = float | torch.Tensor | None  # a per-tensor scale: python float, 0-d tensor, or None (1.0)


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """One fp8 format's bit layout, as the kernels decode and encode it."""

    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_value: float


FORMATS: dict[torch.dtype, Fp8Format] = {
    torch.float8_e4m3fn: Fp8Format(4, 3, 7, 448.0),
    torch.float8_e5m2: Fp8Format(5, 2, 15, 57344.0),
}


def cache_dtype(kv_cache_dtype: str, serving_dtype: torch.dtype, device_type: str = "cpu") -> torch.dtype:
    """The torch dtype of the KV cache for an engine's ``kv_cache_dtype`` setting on a device of
    ``device_type``. bfloat16 is the serving dtype of a bfloat16 engine (as auto) or a float32
    engine's narrower cache on the CPU (whose kernels widen it as they read it); anything else
    is refused with the reason."""
    if kv_cache_dtype == "auto":
        return serving_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(KV_CACHE_DTYPES)} (got {kv_cache_dtype!r}).")
    dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    if dtype == torch.bfloat16 and serving_dtype != torch.bfloat16:
        if serving_dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype bfloat16 takes a float32 or bfloat16 engine (this one serves "
                             f"{str(serving_dtype).removeprefix('torch.')}); use auto or an fp8 format")
        if device_type != "cpu":
            raise ValueError("kv_cache_dtype bfloat16 with a float32 engine runs on the CPU only (its kernels widen "
                             "the cache as they read it); on a GPU serve --dtype bfloat16 instead")
    return dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FORMATS


def scale_value(scale: Scale) -> float:
    """``scale`` as a python float (None: 1.0); reads a 0-d tensor on the host."""
    if scale is None:
        return 1.0
    value = float(scale)
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"a KV scale must be a positive finite number (got {value}).")
    return value


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    """``x * (1 / scale)`` (the reciprocal rounded to float32 once, as every kernel multiplies)
    saturated to the format's range and rounded to nearest-even in ``dtype``."""
    fmt = FORMATS[dtype]
    scaled = x.float() * (1.0 / scale_value(scale))
    return scaled.clamp(-fmt.max_value, fmt.max_value).to(dtype)


def store_value(x: torch.Tensor, cache_dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    """What a cache of ``cache_dtype`` stores for ``x``: quantized for fp8, else ``x`` in that dtype."""
    if is_fp8(cache_dtype):
        return quantize(x, cache_dtype, scale)
    return x.to(cache_dtype)


def dequantize(stored: torch.Tensor, scale: Scale) -> torch.Tensor:
    """float32 values of cache rows: ``stored * scale`` for fp8, the float rows as they are else."""
    if not is_fp8(stored.dtype):
        return stored.float()
    return stored.float() * scale_value(scale)


# Where a calculated scale puts the calibration K/V's largest magnitude (vLLM's K_SCALE_CONSTANT
# and V_SCALE_CONSTANT): well inside e4m3's 448, so later, larger values have headroom before
# they saturate (measured: bench/fp8_kv_agreement.py; amax -> 448 clipped later prompts' K).
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def amax_scale(x: torch.Tensor, target: float) -> float:
    """The per-tensor scale that maps ``x``'s largest magnitude to ``target`` (a calculated
    scale); 1.0 when ``x`` is empty or all zeros. Reads the value on the host."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    if not amax > 0.0 or amax == float("inf"):
        return 1.0
    return amax / target


def decode_table(dtype: torch.dtype) -> torch.Tensor:
    """[256] float32: the value of every byte of ``dtype`` (the native kernels' lookup table)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
