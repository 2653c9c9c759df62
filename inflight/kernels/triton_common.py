"""Input checks and launch heuristics shared by the Triton kernel wrappers.

Owns: the ``ValueError`` messages for malformed kernel inputs (the wrappers raise them before
launching, because a bad stride or head count inside a kernel is silent memory corruption)
and small device queries. Knows nothing about the engine, and imports no Triton.
"""

from __future__ import annotations

import functools

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=8)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device``; a small stand-in off CUDA (interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must have dtype {names} (got {t.dtype}).")


def check_ndim(name: str, t: torch.Tensor, ndim: int, shape_doc: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {shape_doc} (got shape {tuple(t.shape)}).")


def check_same_device(**tensors: torch.Tensor) -> None:
    first, *rest = tensors.values()
    device = first.device
    if any(t.device != device for t in rest):  # cheap on the hot path: runs every launch
        listed = ", ".join(f"{n} on {t.device}" for n, t in tensors.items())
        raise ValueError(f"kernel inputs must share one device ({listed}).")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """``k_cache``/``v_cache``: [num_blocks, block_size, num_kv_heads, head_dim], last dim dense."""
    doc = "[num_blocks, block_size, num_kv_heads, head_dim]"
    check_ndim("k_cache", k_cache, 4, doc)
    check_ndim("v_cache", v_cache, 4, doc)
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape (got {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)})."
        )
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ ({k_cache.dtype} vs {v_cache.dtype}).")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "k_cache and v_cache must share strides and be contiguous in head_dim "
            f"(got {k_cache.stride()} and {v_cache.stride()})."
        )


def check_heads(query: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Validate query [n, num_heads, head_dim] against the cache; return the GQA group size."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, cache_head_dim = k_cache.shape[2], k_cache.shape[3]
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}.")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})."
        )
    check_dtype("query", query, FLOAT_DTYPES)
    return num_heads // num_kv_heads


def check_paged_inputs(
    num_seqs: int,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    context_lens: torch.Tensor,  # [num_seqs]
) -> None:
    check_ndim("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    check_ndim("context_lens", context_lens, 1, "[num_seqs]")
    check_dtype("block_tables", block_tables, INDEX_DTYPES)
    check_dtype("context_lens", context_lens, INDEX_DTYPES)
    if block_tables.shape[0] < num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables ({tuple(block_tables.shape)}) and context_lens "
            f"({tuple(context_lens.shape)}) must have a row per sequence ({num_seqs})."
        )
