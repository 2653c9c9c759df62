"""Native CPU attention over bfloat16 KV caches of a float32 engine (``kv_cache_dtype
bfloat16``): the ctypes side of ``cpu_bf16_kv.h``.

A stored value is the float32 K or V rounded to nearest-even to bfloat16 (torch's cast; the
reference stores ``x.to(torch.bfloat16)``), and a read widens it back exactly, so the cache holds
what the reference holds and every kernel reads what the reference reads. Decode attention reads
the cache in place (``inflight_paged_decode_attention_bf16``, bound in :mod:`.cpu_native` as the
float one is: each block's rows widened into a per-thread float scratch, then the float kernel's
code), half the bytes of a float32 cache.
Prefill attention widens the blocks the step reads into a compact float32 cache once
(``inflight_widen_bf16_blocks``) and runs the float prefill kernel on it with the block tables
renumbered, as the fp8 caches do (:mod:`.cpu_fp8_kv`). The store (:func:`store`:
``inflight_store_kv_cache_bf16``) rounds as torch's cast does. float32 queries and rows with heads
packed only; anything else takes the torch reference. Knows nothing about the model or the engine.
"""

from __future__ import annotations

import ctypes

import torch

from inflight.kernels import cpu_fp8_kv


def is_bf16_of_float(cache_dtype: torch.dtype, query_dtype: torch.dtype) -> bool:
    """A bfloat16 cache read by float32 queries (a float32 engine with ``kv_cache_dtype bfloat16``)."""
    return cache_dtype == torch.bfloat16 and query_dtype == torch.float32


def native_ok(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """bfloat16 caches, contiguous, and float32 CPU queries with heads and features packed."""
    return k_cache.dtype == v_cache.dtype == torch.bfloat16 and cpu_fp8_kv.layout_ok(query, k_cache, v_cache)


def widened_blocks(
    lib: ctypes.CDLL, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks the sequences read (their first ``ceil(context_len / block_size)`` table
    entries), widened into compact float32 caches ``[num_used, block_size, H_kv, D]``, and the
    block tables renumbered into them (int32, same shape)."""
    block_size = k_cache.shape[1]
    ids, renumbered = cpu_fp8_kv.used_blocks(block_tables, context_lens, block_size)
    block_elems = block_size * k_cache.shape[2] * k_cache.shape[3]
    caches = []
    for cache in (k_cache, v_cache):
        out = torch.empty((ids.shape[0], *cache.shape[1:]), dtype=torch.float32)
        lib.inflight_widen_bf16_blocks(cache.data_ptr(), ids.data_ptr(), ids.shape[0], block_elems, out.data_ptr(),
                                       torch.get_num_threads())  # fmt: skip
        caches.append(out)
    return caches[0], caches[1], renumbered


def store(lib: ctypes.CDLL, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slot_mapping: torch.Tensor) -> bool:  # fmt: skip
    """Store float32 ``key``/``value`` rows (heads packed, any row stride) into bfloat16 caches,
    rounded as torch's cast rounds; False (nothing written) for any other pair of dtypes."""
    if not (k_cache.dtype == v_cache.dtype == torch.bfloat16 and key.dtype == value.dtype == torch.float32):
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    lib.inflight_store_kv_cache_bf16(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr(), key.shape[0], key.shape[1] * key.shape[2], torch.get_num_threads(),
    )
    return True

