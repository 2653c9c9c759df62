"""Triton kernel writing new K/V rows into the paged cache by slot mapping.

Owns ``store_kv_cache`` (same signature as :func:`inflight.kernels.reference.store_kv_cache`).
One program per token copies that token's ``[num_kv_heads, head_dim]`` K and V rows into
slot ``slot_mapping[t]`` (``block_id * block_size + offset``); a negative slot skips the
token. An fp8 cache is written as bytes, each value times ``1 / scale`` encoded by
:func:`inflight.kernels.triton_fp8.fp8_encode` (saturating, nearest-even). Knows nothing about which blocks belong to which request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels.fp8_kv import Scale
from inflight.kernels.triton_common import (
    check_dtype,
    check_kv_cache,
    check_ndim,
    check_same_device,
    next_power_of_2,
)
from inflight.kernels.triton_fp8 import fp8_encode, kv_args


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_ptr,  # [num_tokens]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    k_inv,  # 1 / the K scale (fp8 caches)
    v_inv,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    MANT: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_VALUE: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    SUB_INV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padding token: nothing to store
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    src_k = key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if KV_FP8:  # the caches are bytes
        k8 = fp8_encode(k.to(tl.float32) * k_inv, MANT, BIAS, MAX_VALUE, MIN_NORMAL, SUB_INV)
        v8 = fp8_encode(v.to(tl.float32) * v_inv, MANT, BIAS, MAX_VALUE, MIN_NORMAL, SUB_INV)
        tl.store(k_cache_ptr + dst, k8.to(tl.uint8), mask=mask)
        tl.store(v_cache_ptr + dst, v8.to(tl.uint8), mask=mask)
    else:
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    *,
    k_scale: Scale = None,
    v_scale: Scale = None,
) -> None:
    """Write each token's K and V into its slot of the paged cache (in place), quantized when
    the cache is fp8."""
    fp8 = kv_args(k_cache, v_cache, k_scale, v_scale)
    if fp8 is None:
        check_kv_cache(k_cache, v_cache)
    doc = "[num_tokens, num_kv_heads, head_dim]"
    check_ndim("key", key, 3, doc)
    check_ndim("value", value, 3, doc)
    check_ndim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    num_tokens = key.shape[0]
    if value.shape != key.shape or tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
            f"[num_tokens, {k_cache.shape[2]}, {k_cache.shape[3]}] to match the cache."
        )
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens."
        )
    check_same_device(key=key, value=value, k_cache=k_cache, slot_mapping=slot_mapping)
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    block_h, block_d = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache if fp8 is None else fp8.k_cache,
        v_cache if fp8 is None else fp8.v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        1.0 if fp8 is None else 1.0 / fp8.k_scale,
        1.0 if fp8 is None else 1.0 / fp8.v_scale,
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        KV_FP8=fp8 is not None,
        MANT=0 if fp8 is None else fp8.mant,
        BIAS=0 if fp8 is None else fp8.bias,
        MAX_VALUE=0.0 if fp8 is None else fp8.max_value,
        MIN_NORMAL=0.0 if fp8 is None else fp8.min_normal,
        SUB_INV=0.0 if fp8 is None else 1.0 / fp8.sub_step,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )
