"""Native prefill attention on the CPU: the ctypes binding of ``cpu_prefill_attention.h``.

:func:`bound_to` gives ``paged_prefill_attention`` with the reference's signature
(:func:`inflight.kernels.reference.paged_prefill_attention`): prompt chunks attend to their
paged context, causal within the chunk, with sliding windows and attention sinks. The kernel
scores a block of query rows against a tile of keys at a time with an online softmax (flash
attention's loop, see the header) and reads K/V in place from the cache, so the chunk's own K/V
must be stored there first, as the decoder does before it attends. float32 queries with
heads and features packed (any token stride) take the kernel; anything else takes the reference.

Chunks of more than :data:`NATIVE_MAX_QUERIES` queries stay on the reference (SDPA, one call
per sequence, with the chunk's own ``key``/``value`` when it is a whole prompt): on long chunks
SDPA's tiles catch up. Measured on 2 cores with ``python -m bench.cpu.prefill``
(chunks of n tokens filling a 2048-token step; head_dim 64/128, GQA 2-4; kernel time against
SDPA's): x1.4-1.5 at n=256, x1.5-1.6 at 512, x1.1-1.2 at 1024, x0.94-1.05 at 2048; x1.7-2.5 on the
peers' burst step (22 prompts of 93 tokens). Knows nothing about the
model or the engine.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from inflight.kernels import cpu_bf16_kv, cpu_fp8_kv, reference
from inflight.kernels.fp8_kv import Scale, is_fp8

_ptr, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "inflight_paged_prefill_attention_f32": (
        ctypes.c_int, [_ptr, _i64] + [_ptr] * 6 + [_i64] * 7 + [_f32, _int, _i64, _ptr]),
}
# A sequence with more queries in the step than this takes the reference (see above).
NATIVE_MAX_QUERIES = 1536


def bound_to(library: Callable[[], ctypes.CDLL]) -> Callable[..., torch.Tensor]:
    """``paged_prefill_attention`` running ``library()``'s kernel (loaded on first call)."""

    def paged_prefill_attention(
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets of each sequence's queries
        context_lens: torch.Tensor,  # [num_seqs] int32, cached tokens incl. this chunk
        scale: float,
        key: torch.Tensor | None = None,  # the chunk's own K (the reference's shortcut)
        value: torch.Tensor | None = None,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] float32 logits
        *,
        k_scale: Scale = None,
        v_scale: Scale = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        if cpu_fp8_kv.native_ok(query, k_cache, v_cache):  # the float kernel on the blocks decoded once
            k_cache, v_cache, block_tables = cpu_fp8_kv.dequantized_blocks(
                library(), k_cache, v_cache, block_tables, context_lens, (k_scale, v_scale))
            key = value = None  # the float copies hold what attention must see (rounded through fp8)
        elif cpu_bf16_kv.native_ok(query, k_cache, v_cache):  # the same, widened from bfloat16
            k_cache, v_cache, block_tables = cpu_bf16_kv.widened_blocks(library(), k_cache, v_cache, block_tables,
                                                                        context_lens)  # fmt: skip
            key = value = None
        elif is_fp8(k_cache.dtype) or is_fp8(v_cache.dtype) or cpu_bf16_kv.is_bf16_of_float(k_cache.dtype,
                                                                                              query.dtype):
            return reference.paged_prefill_attention(query, k_cache, v_cache, block_tables, query_start_loc,
                                                     context_lens, scale, key, value, sliding_window, sinks,
                                                     k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        args = (query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)
        if not native_layout(query, k_cache, v_cache):
            return reference.paged_prefill_attention(*args, key, value, sliding_window, sinks)
        starts = checked_starts(query_start_loc, context_lens, query.shape[0])
        out = run(library().inflight_paged_prefill_attention_f32, *args, sliding_window, sinks)
        long_chunks(out, starts, query, k_cache, v_cache, block_tables, context_lens, scale, key, value,
                    sliding_window, sinks)  # fmt: skip
        return out

    return paged_prefill_attention


def native_layout(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """float32 on the CPU, query rows of packed heads (any token stride), contiguous caches."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    return (query.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and query.device.type == "cpu"
            and query.stride(2) == 1 and query.stride(1) == head_dim
            and k_cache.is_contiguous() and v_cache.is_contiguous() and num_heads % k_cache.shape[2] == 0)


def run(
    kernel: Callable[..., int], query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
    sliding_window: int | None, sinks: torch.Tensor | None,
) -> torch.Tensor:
    """The kernel on checked arguments (:func:`native_layout` and :func:`checked_starts` hold); the
    rows of sequences with more than :data:`NATIVE_MAX_QUERIES` queries are left unwritten
    (:func:`long_chunks`)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must be [num_heads] = [{num_heads}] (got {tuple(sinks.shape)}).")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    if num_tokens == 0:
        return out
    tables = block_tables.to(torch.int32).contiguous()
    status = kernel(
        query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        starts.data_ptr(), lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, k_cache.shape[2], head_dim,
        k_cache.shape[1], tables.shape[1], NATIVE_MAX_QUERIES, scale, torch.get_num_threads(), sliding_window or 0,
        None if sinks is None else sinks.data_ptr(),
    )
    if status != 0:
        raise MemoryError("paged_prefill_attention: no memory for the per-thread scratch")
    return out


def checked_starts(query_start_loc: torch.Tensor, context_lens: torch.Tensor, num_tokens: int) -> list[int]:
    """``query_start_loc`` as a list, after checking it against the queries and the contexts."""
    starts, lens = query_start_loc.tolist(), context_lens.tolist()
    if len(starts) != len(lens) + 1 or starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(f"query_start_loc must be [num_seqs + 1] from 0 to {num_tokens} (got {starts}).")
    if any(end < begin or n < end - begin for begin, end, n in zip(starts, starts[1:], lens, strict=False)):
        raise ValueError("every sequence's context must hold its chunk (context_lens >= its query count).")
    return starts


def long_chunks(
    out: torch.Tensor, starts: list[int], query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
    key: torch.Tensor | None, value: torch.Tensor | None, sliding_window: int | None, sinks: torch.Tensor | None,
) -> None:
    """The rows the kernel left: each sequence with more than :data:`NATIVE_MAX_QUERIES`
    queries, from the reference (``starts``: ``query_start_loc`` as a list)."""
    for s in range(len(starts) - 1):
        begin, end = starts[s], starts[s + 1]
        if end - begin <= NATIVE_MAX_QUERIES:
            continue
        rows = slice(begin, end)
        out[rows] = reference.paged_prefill_attention(
            query[rows], k_cache, v_cache, block_tables[s : s + 1],
            torch.tensor([0, end - begin], dtype=torch.int32), context_lens[s : s + 1], scale,
            None if key is None else key[rows], None if value is None else value[rows], sliding_window, sinks,
        )  # fmt: skip
