"""The paged cache of multi-head latent attention: its tensors, its bytes, and what it refuses.

Per layer and token MLA caches one normed latent of ``kv_lora_rank`` values and one roped key of
``qk_rope_head_dim`` values, shared by every head and replicated on every tensor-parallel rank:
``(latent_cache [num_blocks, block_size, 1, kv_lora_rank], pe_cache [num_blocks, block_size, 1,
qk_rope_head_dim])``, the pair that takes the place of a layer's (K, V) in the runner's
``kv_caches`` (so host-tier copies, block tables and preemption treat it as any other cache). The
same model served as GQA would cache, per rank, ``2 * num_heads/N * (qk_nope + qk_rope)`` values a
token (K with v_head_dim V): :func:`kv_size_sentence` says both in the start-up log. Knows nothing
about scheduling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inflight.kernels.cpu_huge_pages import cache_zeros
from inflight.runtime.model.spec_types import ModelSpec


def check_mla_engine(spec: ModelSpec, kv_cache_dtype: str, enable_lora: bool) -> None:
    """``ValueError`` with the reason for an engine setting latent attention does not support."""
    if spec.mla is None:
        return
    if kv_cache_dtype != "auto":  # an fp8 format, or bfloat16 under a float32 engine
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported with multi-head latent attention "
                         "(DeepSeek-V2/V3): the latent cache is stored in the serving dtype (its fp8 format with "
                         "per-layer scales, and a narrower float one, are not implemented); use kv_cache_dtype "
                         "auto.")  # fmt: skip
    if enable_lora:
        raise ValueError("enable_lora is not supported for DeepSeek-V3 or V2 (latent attention has no q/k/v/o "
                         "adapter slots); serve it without LoRA.")  # fmt: skip


def mla_cache_shapes(spec: ModelSpec, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The latent cache's and the roped-key cache's shapes for one layer."""
    assert spec.mla is not None
    return ((num_blocks, block_size, 1, spec.mla.kv_lora_rank), (num_blocks, block_size, 1, spec.mla.qk_rope_head_dim))


def allocate_mla_caches(
    spec: ModelSpec, num_local_heads: int, num_layers: int, blocks: tuple[int, int], dtype: torch.dtype,
    device: torch.device, say: Callable[[str], object],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One ``(latent_cache, pe_cache)`` pair per layer, zeroed, for ``blocks`` ``(num_blocks,
    block_size)``; ``say`` gets :func:`kv_size_sentence` (the start-up log)."""
    latent, pe = mla_cache_shapes(spec, *blocks)
    say(kv_size_sentence(spec, num_local_heads, dtype.itemsize, num_layers))
    return [(cache_zeros(latent, dtype, device), cache_zeros(pe, dtype, device))
            for _ in range(num_layers)]  # fmt: skip


def mla_block_bytes(spec: ModelSpec, num_layers: int, block_size: int, elem_bytes: int) -> int:
    """Bytes of one block of every layer's latent cache (what sizes the block count)."""
    return num_layers * block_size * mla_values_per_token(spec) * elem_bytes


def mla_values_per_token(spec: ModelSpec) -> int:
    """Cached values a token per layer: the latent plus the roped key."""
    assert spec.mla is not None
    return spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim


def gqa_values_per_token(spec: ModelSpec, num_local_heads: int) -> int:
    """What the same layer would cache a token as plain multi-head attention on this rank (a key of
    ``qk_nope + qk_rope`` and a value of ``v_head_dim`` per head)."""
    assert spec.mla is not None
    mla = spec.mla
    return num_local_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)


def kv_size_sentence(spec: ModelSpec, num_local_heads: int, elem_bytes: int, num_layers: int) -> str:
    """The start-up log's comparison of the latent cache with the same model's GQA cache."""
    mla_bytes = mla_values_per_token(spec) * elem_bytes * num_layers
    gqa_bytes = gqa_values_per_token(spec, num_local_heads) * elem_bytes * num_layers
    return (f"MLA latent cache: {mla_bytes} bytes a token ({num_layers} layers x ({spec.mla.kv_lora_rank} latent "
            f"+ {spec.mla.qk_rope_head_dim} rope) values), {gqa_bytes / mla_bytes:.1f}x smaller than the "
            f"{gqa_bytes} bytes of the same model's per-head K/V")  # fmt: skip
