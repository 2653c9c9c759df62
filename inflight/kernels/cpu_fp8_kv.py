"""Native CPU attention over fp8 KV caches: the ctypes side of ``cpu_kernels.c``'s fp8 kernels.

Decode attention reads the fp8 cache in place (``inflight_paged_decode_attention_fp8``: each
block's rows decoded into a per-thread float scratch through a 256-entry table of byte value
times the layer's scale, exact, then the float kernel's code). Prefill attention decodes the
blocks the step reads into a compact float32 cache once (``inflight_dequantize_fp8_blocks``) and
runs the float prefill kernel on it with the block tables renumbered: a prompt chunk reads
each block many times, so decoding once is cheaper than decoding per query tile. The store
(:func:`store`: ``inflight_store_kv_cache_fp8``) encodes as the reference quantizes. Both follow
:mod:`inflight.kernels.fp8_kv` (``stored * scale``) and take float32 queries with heads packed;
anything else takes the torch reference. Knows nothing about the model or the engine.
"""

from __future__ import annotations

import ctypes

import torch

from inflight.kernels import fp8_kv, reference
from inflight.kernels.fp8_kv import Scale


def _lut(dtype: torch.dtype, scale: Scale) -> torch.Tensor:
    """[256] float32: each byte's value times ``scale``, rounded as the reference multiplies."""
    return fp8_kv.decode_table(dtype) * fp8_kv.scale_value(scale)


def native_ok(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """fp8 caches of one format, contiguous, and float32 CPU queries with heads and features packed."""
    return fp8_kv.is_fp8(k_cache.dtype) and k_cache.dtype == v_cache.dtype and layout_ok(query, k_cache, v_cache)


def layout_ok(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """What the native kernels over a narrow cache (fp8 here, bfloat16 in :mod:`.cpu_bf16_kv`)
    take besides its dtype: float32 CPU queries with heads and features packed, whole query
    groups per KV head, contiguous caches."""
    return (query.dtype == torch.float32 and query.device.type == "cpu" and query.dim() == 3
            and query.stride(2) == 1 and query.stride(1) == query.shape[2] and k_cache.is_contiguous()
            and v_cache.is_contiguous() and query.shape[1] % k_cache.shape[2] == 0)  # fmt: skip


def used_blocks(block_tables: torch.Tensor, context_lens: torch.Tensor,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The blocks the sequences read (their first ``ceil(context_len / block_size)`` table
    entries), as sorted distinct ids (int64, contiguous), and the block tables renumbered into
    their positions (int32, ``[num_seqs, width]``): what a prefill step decodes into a compact
    float cache once (fp8 here, bfloat16 in :mod:`.cpu_bf16_kv`)."""
    lens = context_lens.tolist()
    width = max((-(-n // block_size) for n in lens), default=0)
    width = max(width, 1)
    table = block_tables[:, :width].long()
    used = torch.arange(width)[None, :] < torch.tensor([-(-n // block_size) for n in lens])[:, None]
    ids, renumbered = torch.unique(torch.where(used, table, 0), return_inverse=True)  # unused: block 0
    return ids.contiguous(), renumbered.to(torch.int32)


def decode_attention(
    lib: ctypes.CDLL, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, sliding_window: int | None,
    sinks: torch.Tensor | None, kv_scales: tuple[Scale, Scale],
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """:func:`inflight.kernels.reference.paged_decode_attention` over fp8 caches."""
    k_scale, v_scale = kv_scales
    if not (native_ok(query, k_cache, v_cache) and query.is_contiguous()):
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                                                sliding_window, sinks, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    num_seqs, num_heads, head_dim = query.shape
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [num_heads] = [{num_heads}] (got {tuple(sinks.shape)}).")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    k_lut, v_lut = _lut(k_cache.dtype, k_scale), _lut(v_cache.dtype, v_scale)
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    status = lib.inflight_paged_decode_attention_fp8(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_lut.data_ptr(), v_lut.data_ptr(),
        tables.data_ptr(), lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, k_cache.shape[2], head_dim,
        k_cache.shape[1], tables.shape[1], scale, torch.get_num_threads(), sliding_window or 0,
        None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise MemoryError("paged_decode_attention (fp8): no memory for the per-thread scratch")
    return out


def dequantized_blocks(
    lib: ctypes.CDLL, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, kv_scales: tuple[Scale, Scale],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks the sequences read (their first ``ceil(context_len / block_size)`` table
    entries), decoded into compact float32 caches ``[num_used, block_size, H_kv, D]``, and the
    block tables renumbered into them (int32, same shape)."""
    block_size = k_cache.shape[1]
    ids, renumbered = used_blocks(block_tables, context_lens, block_size)
    block_elems = block_size * k_cache.shape[2] * k_cache.shape[3]
    caches = []
    for cache, kv_scale in ((k_cache, kv_scales[0]), (v_cache, kv_scales[1])):
        out = torch.empty((ids.shape[0], *cache.shape[1:]), dtype=torch.float32)
        lut = _lut(cache.dtype, kv_scale)
        lib.inflight_dequantize_fp8_blocks(cache.data_ptr(), ids.data_ptr(), ids.shape[0], block_elems,
                                           lut.data_ptr(), out.data_ptr(), torch.get_num_threads())  # fmt: skip
        caches.append(out)
    return caches[0], caches[1], renumbered


def store(lib: ctypes.CDLL, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          slot_mapping: torch.Tensor, kv_scales: tuple[Scale, Scale]) -> bool:  # fmt: skip
    """Store float32 ``key``/``value`` rows (heads packed, any row stride) into fp8 caches of one
    format, encoded as the reference quantizes; False (nothing written) for any other cache."""
    if not (fp8_kv.is_fp8(k_cache.dtype) and k_cache.dtype == v_cache.dtype):
        return False
    fmt = fp8_kv.FORMATS[k_cache.dtype]
    slots = slot_mapping.to(torch.int64).contiguous()
    lib.inflight_store_kv_cache_fp8(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        slots.data_ptr(), key.shape[0], key.shape[1] * key.shape[2], 1.0 / fp8_kv.scale_value(kv_scales[0]),
        1.0 / fp8_kv.scale_value(kv_scales[1]), fmt.mantissa_bits, fmt.bias, fmt.max_value, torch.get_num_threads(),
    )
    return True

