"""The kernel bundle type: ``KernelOps``, and ``TORCH_OPS``, the bundle of torch references.

A leaf: imports only torch, :mod:`inflight.kernels.reference`, :mod:`.lora_reference`, :mod:`.mla_reference` and
:mod:`.decode_block`, so the backends that build a bundle (:mod:`.cpu_native`,
:mod:`.triton_ops`) and :mod:`.dispatch`, which picks one, all import it without importing
each other. Knows nothing about which backend runs where.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inflight.kernels import decode_block, lora_reference, mla_reference, reference


@dataclass(frozen=True, slots=True)
class KernelOps:
    """The kernels the model calls, all with the reference signatures."""

    name: str
    store_kv_cache: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    linear: Callable[..., torch.Tensor]
    silu_and_mul: Callable[..., torch.Tensor]
    # The decode path never reads a tensor's value on the host (split plans come from
    # shapes), so a decode step can be captured in a graph. The torch reference reads
    # context lengths with .tolist() and is not.
    graph_safe: bool = False
    # Mixture-of-experts SwiGLU MLP over routed tokens. The torch reference unless a bundle
    # brings its own; it reads expert counts on the host, so it cannot run inside a captured
    # CUDA graph: the Triton bundle (graph-safe) brings one that can.
    fused_moe: Callable[..., torch.Tensor] = reference.fused_moe
    # A pure-decode step's attention block in one call (:mod:`.decode_block`): q/k/v split,
    # qk-norm, rotary, KV store, decode attention. None: the decoder calls those ops one by one.
    decode_attention_block: Callable[..., torch.Tensor] | None = None
    # A pure-decode step's whole decoder-layer stack and final norm in one call
    # (:mod:`.decode_stack`), over MKL-packed dense layers; it answers None for a step it does
    # not take. None: the decoder runs its layers op by op.
    decode_layer_stack: Callable[..., torch.Tensor | None] | None = None
    # Multi-LoRA: ``out[t] += (x[t] @ a[s].T) @ b[s].T`` for each row's adapter slot ``s``
    # (-1: none), in place into a possibly strided ``out``. The torch reference (rows grouped
    # by slot; reads the slots on the host) unless a bundle brings its own: the Triton bundle's
    # never reads them on the host, so it runs inside a captured CUDA graph.
    lora_delta: Callable[..., None] = lora_reference.lora_delta
    # Multi-head latent attention's absorbed decode over the latent cache (DeepSeek-V3:
    # :mod:`.mla_reference`); the torch reference unless a bundle brings its own.
    paged_mla_decode: Callable[..., torch.Tensor] = mla_reference.paged_mla_decode
    # Its absorbed prefill: chunks of query tokens over the latent cache, causally (the model picks
    # it per chunk, :mod:`inflight.runtime.model.mla`).
    paged_mla_prefill: Callable[..., torch.Tensor] = mla_reference.paged_mla_prefill


TORCH_OPS = KernelOps(
    name="torch",
    store_kv_cache=reference.store_kv_cache,
    paged_decode_attention=reference.paged_decode_attention,
    paged_prefill_attention=reference.paged_prefill_attention,
    rms_norm=reference.rms_norm,
    rotary_embedding=reference.rotary_embedding,
    linear=reference.linear,
    silu_and_mul=reference.silu_and_mul,
    decode_attention_block=decode_block.decode_attention_block,
)
