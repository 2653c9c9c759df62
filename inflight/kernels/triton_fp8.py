"""fp8 KV caches in the Triton kernels: byte encode/decode with integer bit operations, the K/V
tile load that decodes, and the host side that hands a cache to a kernel.

The kernels see an fp8 cache as its bytes (a ``uint8`` view of the ``float8_e4m3fn`` /
``float8_e5m2`` tensor) and convert with bit operations on int32, so one kernel runs the same
on every GPU (no fp8 conversion instructions needed) and in Triton's interpreter, which has no
fp8 types. The formats and their rounding are :mod:`inflight.kernels.fp8_kv`'s: the store
multiplies by ``1 / scale`` (a float32 argument), saturates, rounds to nearest-even; the read
multiplies the decoded byte by ``scale``. Knows nothing about the model or the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from inflight.kernels import fp8_kv
from inflight.kernels.fp8_kv import Scale


@triton.jit
def fp8_encode(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_VALUE: tl.constexpr, MIN_NORMAL: tl.constexpr,
               SUB_INV: tl.constexpr):  # fmt: skip
    """float32 ``x`` (already times 1 / scale) -> fp8 bytes (int32 0..255): saturated to
    ``MAX_VALUE``, nearest-even. Normal results round the float's bits in place (a carry moves
    into the exponent); below ``MIN_NORMAL`` a multiple of the subnormal step (``x * SUB_INV``
    rounded to the nearest integer, ties to even)."""
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.minimum(tl.abs(x), MAX_VALUE)
    bits = a.to(tl.int32, bitcast=True)
    rounded = bits + ((1 << (22 - MANT)) - 1) + ((bits >> (23 - MANT)) & 1)
    normal = (rounded >> (23 - MANT)) - ((127 - BIAS) << MANT)
    y = tl.minimum(a, MIN_NORMAL) * SUB_INV  # at most 2^MANT: no int32 overflow on normal lanes
    whole = y.to(tl.int32)  # y >= 0: truncation is floor
    frac = y - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    sub = whole + up.to(tl.int32)
    return tl.where(a < MIN_NORMAL, sub, normal) | sign


@triton.jit
def fp8_decode(b, MANT: tl.constexpr, BIAS: tl.constexpr, SUB_STEP: tl.constexpr):
    """fp8 bytes (any integer type, 0..255) -> float32 values (exact)."""
    b = b.to(tl.int32) & 0xFF
    exponent = (b >> MANT) & ((1 << (7 - MANT)) - 1)
    mantissa = b & ((1 << MANT) - 1)
    negative = (b & 0x80) != 0
    normal = (((exponent + (127 - BIAS)) << 23) | (mantissa << (23 - MANT))).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * SUB_STEP, normal)
    return tl.where(negative, -value, value)


@triton.jit
def load_kv_tile_fp8(
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] uint8 (fp8 bytes)
    v_cache_ptr,
    table_row,
    pos,  # [BLOCK_N] token positions
    n_mask,  # [BLOCK_N]
    kv_head,
    stride_cb,
    stride_cs,
    stride_ch,
    offs_d,  # [BLOCK_D]
    d_mask,  # [BLOCK_D]
    k_scale,
    v_scale,
    BLOCK_SIZE: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    SUB_STEP: tl.constexpr,
):
    """``load_kv_tile`` (triton_helpers) over fp8 bytes: float32 ``[BLOCK_N, BLOCK_D]`` K and V
    tiles, each value the decoded byte times its scale (0 where masked)."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    row = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    offs = row[:, None] + offs_d[None, :]
    mask = n_mask[:, None] & d_mask[None, :]
    k = fp8_decode(tl.load(k_cache_ptr + offs, mask=mask, other=0), MANT, BIAS, SUB_STEP) * k_scale
    v = fp8_decode(tl.load(v_cache_ptr + offs, mask=mask, other=0), MANT, BIAS, SUB_STEP) * v_scale
    return k, v


@dataclass(frozen=True, slots=True)
class KvArgs:
    """A K/V cache pair as a kernel takes it: the tensors (byte views of an fp8 cache), the
    scales (1.0 for a float cache) and the format's constants."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: float
    v_scale: float
    fp8: bool
    mant: int = 0
    bias: int = 0
    max_value: float = 0.0
    min_normal: float = 0.0
    sub_step: float = 0.0  # the smallest subnormal's value

    @property
    def constants(self) -> dict[str, object]:
        """The kernels' fp8 constexprs (placeholders for a float cache)."""
        return {"KV_FP8": self.fp8, "MANT": self.mant, "BIAS": self.bias, "SUB_STEP": self.sub_step}


def kv_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: Scale, v_scale: Scale) -> KvArgs | None:
    """The fp8 caches as a kernel takes them (checked like ``check_kv_cache``); None for float
    caches, which the caller checks and passes as they are (never scaled)."""
    if not (fp8_kv.is_fp8(k_cache.dtype) or fp8_kv.is_fp8(v_cache.dtype)):
        return None
    doc = "[num_blocks, block_size, num_kv_heads, head_dim]"
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be {doc} (got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}).")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ ({k_cache.dtype} vs {v_cache.dtype}).")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share strides and be contiguous in head_dim "
                         f"(got {k_cache.stride()} and {v_cache.stride()}).")  # fmt: skip
    fmt = fp8_kv.FORMATS[k_cache.dtype]
    return KvArgs(
        k_cache.view(torch.uint8), v_cache.view(torch.uint8), fp8_kv.scale_value(k_scale),
        fp8_kv.scale_value(v_scale), True, fmt.mantissa_bits, fmt.bias, fmt.max_value,
        2.0 ** (1 - fmt.bias), 2.0 ** (1 - fmt.bias - fmt.mantissa_bits),
    )  # fmt: skip


FLOAT_KV = {"KV_FP8": False, "MANT": 0, "BIAS": 0, "SUB_STEP": 0.0}  # the constexprs for a float cache
