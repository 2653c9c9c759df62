"""How big the paged KV cache is: the longest sequence, the bytes of one block and the block count.

Pure functions of the model's spec, the config and the device; the runner
(:mod:`inflight.runtime.worker.model_runner`) calls them once at start. The block count comes
from an explicit ``num_kv_blocks``, the free-GPU-memory fraction on CUDA, or enough blocks for
``max_num_sequences`` full-length sequences on the CPU, capped at :data:`CPU_KV_CACHE_CAP_BYTES`;
``max_tokens_in_paged_kv_cache`` caps any of them. An MLA model caches one latent and one roped
key a token per layer (:mod:`inflight.runtime.model.mla_kv`); a hybrid model's linear-attention
layers hold no KV (:mod:`.hybrid_cache`). With per-group KV tables (:mod:`.kv_layout`) the runner
counts a block per group: its bytes cover every group's layer slots, padding included.
"""

from __future__ import annotations

import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.model.mla_kv import mla_block_bytes
from inflight.runtime.model.spec_types import ModelSpec
from inflight.runtime.worker.hybrid_cache import num_attention_layers

CPU_KV_CACHE_CAP_BYTES = 4 << 30


def max_model_len(spec: ModelSpec, config: EngineConfig) -> int:
    """The longest sequence served: the config's, refused past what the model supports."""
    limit = spec.max_position_embeddings  # a sliding window is enforced in attention, not here
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds what the model supports ({limit}).")
    return config.max_model_len


def block_bytes(spec: ModelSpec, num_layers: int, block_size: int, num_local_kv_heads: int,
                kv_dtype: torch.dtype) -> int:
    """Bytes of one block of the cache on this rank (its KV heads), in the cache's dtype (fp8: one
    byte a value, so the same memory holds twice the blocks of bf16)."""
    elem = torch.finfo(kv_dtype).bits // 8
    if spec.mla is not None:  # one latent + roped key a token per layer
        return mla_block_bytes(spec, num_layers, block_size, elem)
    return 2 * num_attention_layers(spec, num_layers) * block_size * num_local_kv_heads * spec.head_dim * elem


def num_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int, block_size: int,
               longest: int) -> int:
    """The block count (see the module docstring); ``longest`` is the resolved max_model_len."""
    if config.num_kv_blocks is not None:
        num = config.num_kv_blocks
    elif device.type == "cuda":
        torch.cuda.synchronize()
        free, _total = torch.cuda.mem_get_info(device)
        num = int(free * config.kv_cache_free_gpu_mem_fraction) // bytes_per_block
    else:
        wanted = config.max_num_sequences * -(-longest // block_size)
        num = min(wanted, CPU_KV_CACHE_CAP_BYTES // bytes_per_block)
    if num < 1:
        raise ValueError("no memory left for even one KV block; lower max_model_len or free memory.")
    if config.max_tokens_in_paged_kv_cache is not None:
        num = min(num, config.max_tokens_in_paged_kv_cache // block_size)
    return int(num)
