"""The Triton kernel bundle: ``TRITON_OPS``, with the reference signatures.

Owns nothing but the assembly (the bundle type is :mod:`inflight.kernels.ops`'s);
:mod:`inflight.kernels.dispatch` decides when it is used (importing this module imports Triton and JIT-decorates the kernels, so with
``TRITON_INTERPRET=1`` it must be imported after that variable is set).
"""

from __future__ import annotations

from inflight.kernels import reference
from inflight.kernels.ops import KernelOps
from inflight.kernels.triton_activation import silu_and_mul
from inflight.kernels.triton_decode_attention import paged_decode_attention
from inflight.kernels.triton_kv_store import store_kv_cache
from inflight.kernels.triton_lora import lora_delta
from inflight.kernels.triton_mla_decode import paged_mla_decode
from inflight.kernels.triton_mla_prefill import paged_mla_prefill
from inflight.kernels.triton_moe import fused_moe
from inflight.kernels.triton_norm_rope import rms_norm, rotary_embedding
from inflight.kernels.triton_prefill_attention import paged_prefill_attention

TRITON_OPS = KernelOps(
    name="triton",
    store_kv_cache=store_kv_cache,
    paged_decode_attention=paged_decode_attention,
    paged_prefill_attention=paged_prefill_attention,
    rms_norm=rms_norm,
    rotary_embedding=rotary_embedding,
    linear=reference.linear,  # cuBLAS through torch
    silu_and_mul=silu_and_mul,
    graph_safe=True,
    fused_moe=fused_moe,
    lora_delta=lora_delta,
    paged_mla_decode=paged_mla_decode,
    paged_mla_prefill=paged_mla_prefill,
)
