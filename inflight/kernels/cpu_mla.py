"""The CPU bundle's paged MLA decode and prefill: ``paged_mla_decode`` and ``paged_mla_prefill`` with
:mod:`.mla_reference`'s signatures.

Float32 on the CPU with contiguous caches and queries whose rows of heads have a unit feature
stride runs ``cpu_mla.c`` (one call: sequences x head groups over OpenMP threads, each group
reading the sequence's latents straight through the block table, where the reference gathers a
padded copy of every context first), built by the compile function :func:`bound_to` is given
(cpu_native's: its compiler, flags and cache, keyed by this source), so this module imports no
backend. The prefill's work items are a few query tokens of one sequence x a head group, each
latent block read once for all their rows, scores as register vectors (``cpu_mla.c``). Anything
else (another dtype, another layout, no compiler) takes the reference. The softmax is exact (two
passes over the scores) in float32, as the reference; only the summation order differs. Knows
nothing about the model.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

from inflight.kernels import mla_reference

SOURCE = Path(__file__).with_name("cpu_mla.c")
_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "inflight_mla_decode_f32": (_int, [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]
                                + [_i64] * 5 + [_f32, _int]),
    "inflight_mla_prefill_f32": (_int, [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr]
                                 + [_i64] * 6 + [_f32, _int]),
}


def _native_ok(q_latent: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor,
               pe_cache: torch.Tensor) -> bool:  # fmt: skip
    tensors = (q_latent, q_pe, latent_cache, pe_cache)
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and q_latent.stride(2) == 1 and q_pe.stride(2) == 1 and latent_cache.is_contiguous()
            and pe_cache.is_contiguous() and latent_cache.shape[2] == 1 and pe_cache.shape[2] == 1)  # fmt: skip


def bound_to(
    compile_library: Callable[..., tuple[ctypes.CDLL | None, str]],
) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``(paged_mla_decode, paged_mla_prefill)`` whose C kernels ``compile_library(SOURCE, stem,
    signatures)`` builds and loads on first use; without it every call takes the reference."""

    @lru_cache(maxsize=1)
    def load() -> ctypes.CDLL | None:
        return compile_library(SOURCE, "cpu_mla", _SIGNATURES)[0]

    def paged_mla_decode(
        q_latent: torch.Tensor,  # [num_seqs, num_heads, kv_lora_rank]
        q_pe: torch.Tensor,  # [num_seqs, num_heads, rope_dim]
        latent_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_lora_rank]
        pe_cache: torch.Tensor,  # [num_blocks, block_size, 1, rope_dim]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        context_lens: torch.Tensor,  # [num_seqs] int32
        scale: float,
    ) -> torch.Tensor:  # [num_seqs, num_heads, kv_lora_rank]
        """One query token per sequence attending, in the latent space, to its cached context."""
        lib = load() if _native_ok(q_latent, q_pe, latent_cache, pe_cache) else None
        if lib is None or q_latent.shape[0] == 0:
            return mla_reference.paged_mla_decode(q_latent, q_pe, latent_cache, pe_cache, block_tables,
                                                  context_lens, scale)  # fmt: skip
        num_seqs, num_heads, rank = q_latent.shape
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        out = torch.empty(num_seqs, num_heads, rank, dtype=torch.float32)
        status = lib.inflight_mla_decode_f32(
            q_latent.data_ptr(), q_latent.stride(0), q_latent.stride(1), q_pe.data_ptr(), q_pe.stride(0),
            q_pe.stride(1), latent_cache.data_ptr(), pe_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, rank, q_pe.shape[2], latent_cache.shape[1],
            scale, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("paged_mla_decode: the native kernel could not allocate its score scratch.")
        return out

    def paged_mla_prefill(
        q_latent: torch.Tensor,  # [num_tokens, num_heads, kv_lora_rank], sequences packed back to back
        q_pe: torch.Tensor,  # [num_tokens, num_heads, rope_dim]
        latent_cache: torch.Tensor,  # [num_blocks, block_size, 1, kv_lora_rank]
        pe_cache: torch.Tensor,  # [num_blocks, block_size, 1, rope_dim]
        block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
        query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
        context_lens: torch.Tensor,  # [num_seqs] int32, cached tokens incl. this chunk
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, kv_lora_rank]
        """Chunks of query tokens attending, in the latent space, to their paged context, causally."""
        lib = load() if _native_ok(q_latent, q_pe, latent_cache, pe_cache) else None
        if lib is None or q_latent.shape[0] == 0 or context_lens.shape[0] == 0:
            return mla_reference.paged_mla_prefill(q_latent, q_pe, latent_cache, pe_cache, block_tables,
                                                   query_start_loc, context_lens, scale)  # fmt: skip
        num_tokens, num_heads, rank = q_latent.shape
        tables = block_tables.to(torch.int32).contiguous()
        starts = query_start_loc.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        out = torch.empty(num_tokens, num_heads, rank, dtype=torch.float32)
        status = lib.inflight_mla_prefill_f32(
            q_latent.data_ptr(), q_latent.stride(0), q_latent.stride(1), q_pe.data_ptr(), q_pe.stride(0),
            q_pe.stride(1), latent_cache.data_ptr(), pe_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
            starts.data_ptr(), lens.data_ptr(), out.data_ptr(), num_tokens, lens.shape[0], num_heads, rank,
            q_pe.shape[2], latent_cache.shape[1], scale, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("paged_mla_prefill: the native kernel could not allocate its score scratch.")
        return out

    return paged_mla_decode, paged_mla_prefill
