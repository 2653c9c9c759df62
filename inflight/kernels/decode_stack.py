"""A pure-decode step's whole decoder-layer stack as one kernel call, and its torch reference.

In a pure-decode step each layer of a Llama-family dense model is, per op, eight kernel calls
(two RMSNorms with the residual, four linears, SiLU-and-mul and the attention block of
:mod:`.decode_block`), each a point where a CPU decode lane (:mod:`inflight.runtime.worker.cpu.lanes`)
drops the GIL and may wait for the other lane to give it back. :func:`decode_layer_stack` is
every layer plus the final norm with one signature, so a backend can run it as one native call
(:mod:`.cpu_stack`); this module holds its torch reference (the specification: exactly the
decoder's per-op path over the reference kernels, in its order) and :class:`DecodeStack`, the
stack's weights, checked once when the decoder builds it: :meth:`DecodeStack.build` returns
None for anything the native call does not take (float or odd weights, other dtypes, odd
shapes), and the decoder then keeps its per-op path. Over oneDNN-packed weights (which the
native call cannot multiply by) the stack takes only steps whose every product runs on the
weights' float copies: :attr:`DecodeStack.max_rows`. Knows nothing about the model classes or
the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.kernels import decode_block, reference
from inflight.kernels.cpu_packed import PackedLinearWeight, packed_linear
from inflight.kernels.cpu_weight_layout import PANEL_COLS, from_panels
from inflight.kernels.decode_block import AttentionLayer, DecodeRows


@dataclass(frozen=True, slots=True)
class StackLayer:
    """One dense decoder layer: pre-norms, packed linears (q/k/v and gate/up fused; each may
    hold its float weight for few-row products), and its attention (shape, constants, rope
    table, KV cache)."""

    input_norm: torch.Tensor  # [hidden]
    input_eps: float
    qkv: PackedLinearWeight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    attention: AttentionLayer
    cos_sin: torch.Tensor  # [max_position, rotary_dim] fp32: this layer's rope table
    kv_cache: tuple[torch.Tensor, torch.Tensor]  # [num_blocks, block_size, num_kv_heads, head_dim] each
    o_proj: PackedLinearWeight  # [hidden, q_size]
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor  # [hidden]
    post_eps: float
    gate_up: PackedLinearWeight  # [2 * intermediate, hidden], gate rows then up rows
    gate_up_bias: torch.Tensor | None
    down: PackedLinearWeight  # [hidden, intermediate]
    down_bias: torch.Tensor | None


class DecodeStack:
    """A model's layers and final norm as the one-call stack takes them. Build with :meth:`build`;
    a backend may keep what it derives from the stack (pointer tables) in :attr:`native`."""

    def __init__(self, layers: tuple[StackLayer, ...], final_norm: torch.Tensor, final_eps: float) -> None:
        self.layers = layers
        self.final_norm = final_norm
        self.final_eps = final_eps
        self.hidden = int(final_norm.shape[0])
        self.native: object | None = None  # the backend's own form, made on first use
        weights = [w for layer in layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        limits = [w.stack_rows for w in weights if w.stack_rows is not None]
        # The most rows a step may have to run as one call (None: any): oneDNN weights leave
        # the few-row products on their float copies, and nothing above.
        self.max_rows: int | None = min(limits) if limits else None
        self.has_mkl_weights = any(w.fmt == "mkl" for w in weights)  # the call needs MKL's GEMM

    @classmethod
    def build(cls, layers: list[StackLayer], final_norm: torch.Tensor, final_eps: float) -> DecodeStack | None:
        """The stack, or None when any weight or shape is one the native call does not take."""
        hidden = int(final_norm.shape[0]) if final_norm.dim() == 1 else -1
        ok = bool(layers) and _vector_ok(final_norm, hidden) and all(_layer_ok(layer, hidden) for layer in layers)
        return cls(tuple(layers), final_norm, final_eps) if ok else None


def _float_ok(t: torch.Tensor | None, shape: tuple[int, ...]) -> bool:
    """``t`` is a contiguous float32 CPU tensor of ``shape``."""
    return (t is not None and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
            and tuple(t.shape) == shape)  # fmt: skip


def _vector_ok(t: torch.Tensor | None, size: int) -> bool:
    return _float_ok(t, (size,))


def _packed_ok(w: object, out_features: int, in_features: int, bias: torch.Tensor | None) -> bool:
    if not (isinstance(w, PackedLinearWeight) and tuple(w.shape) == (out_features, in_features)
            and (bias is None or _vector_ok(bias, out_features)) and w.stack_rows != 0):  # fmt: skip
        return False  # stack_rows 0: oneDNN's layout without a float copy, which the call cannot multiply by
    panel_shape = (-(-out_features // PANEL_COLS), in_features, PANEL_COLS)
    return ((w.float_rows is None or _float_ok(w.float_rows, (out_features, in_features)))
            and (w.panels is None or _float_ok(w.panels, panel_shape)))  # fmt: skip


def _layer_ok(layer: StackLayer, hidden: int) -> bool:
    a = layer.attention
    q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    k_cache, v_cache = layer.kv_cache
    cs = layer.cos_sin
    inter = layer.down.shape[1] if isinstance(layer.down, PackedLinearWeight) else -1
    return (_vector_ok(layer.input_norm, hidden) and _vector_ok(layer.post_norm, hidden)
            and _packed_ok(layer.qkv, q_size + 2 * kv_size, hidden, layer.qkv_bias)
            and _packed_ok(layer.o_proj, hidden, q_size, layer.o_bias)
            and _packed_ok(layer.gate_up, 2 * inter, hidden, layer.gate_up_bias)
            and _packed_ok(layer.down, hidden, inter, layer.down_bias)
            and (a.q_norm is None) == (a.k_norm is None)
            and (a.q_norm is None or _vector_ok(a.q_norm, a.head_dim) and _vector_ok(a.k_norm, a.head_dim))
            and (a.sinks is None or _vector_ok(a.sinks, a.num_heads))
            and k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.bfloat16)
            and k_cache.device.type == "cpu"
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dim() == 4
            and k_cache.shape == v_cache.shape and tuple(k_cache.shape[2:]) == (a.num_kv_heads, a.head_dim)
            and cs.dtype == torch.float32 and cs.device.type == "cpu" and cs.dim() == 2 and cs.is_contiguous()
            and cs.shape[1] % 2 == 0 and 0 < cs.shape[1] <= a.head_dim)  # fmt: skip


def _linear(x: torch.Tensor, w: PackedLinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    panels = w.panels_for(x.shape[0])  # few rows on the float copy, where the weight kept one
    if panels is not None:
        return reference.linear(x, from_panels(panels, w.shape[0]), bias)
    rows = w.float_copy_for(x.shape[0])
    return packed_linear(x, w, bias) if rows is None else reference.linear(x, rows, bias)


def decode_layer_stack(
    hidden: torch.Tensor,  # [num_seqs, hidden] float32: the step's embeddings
    rows: DecodeRows,
    stack: DecodeStack,
) -> torch.Tensor:  # [num_seqs, hidden], final-normed
    """Every layer of a pure-decode step (each sequence's one token stored in its KV slot and
    attending to its context), then the final norm: the decoder's per-op path, op for op."""
    residual: torch.Tensor | None = None
    for layer in stack.layers:
        x, residual = reference.rms_norm(hidden, layer.input_norm, layer.input_eps, residual)
        qkv = _linear(x, layer.qkv, layer.qkv_bias)
        out = decode_block.decode_attention_block(qkv, rows, layer.cos_sin, layer.kv_cache, layer.attention)
        x = _linear(out, layer.o_proj, layer.o_bias)
        x, residual = reference.rms_norm(x, layer.post_norm, layer.post_eps, residual)
        hidden = _linear(reference.silu_and_mul(_linear(x, layer.gate_up, layer.gate_up_bias)), layer.down,
                         layer.down_bias)  # fmt: skip
    return reference.rms_norm(hidden, stack.final_norm, stack.final_eps, residual)[0]
