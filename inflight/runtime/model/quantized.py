"""Serving a GGUF file's linear weights in their own block quantization (Q4_0, Q4_1, Q8_0,
Q4_K, Q5_K, Q6_K).

:func:`read_quantized_weights` reads the GGUF tensors of the supported block types as
:class:`~inflight.kernels.quant_reference.QuantizedWeight` under their transformers names,
with llama.cpp's q/k row permutation undone on the packed rows (rows are independent, so
the blocks move whole). :func:`quantize_model` swaps them into a loaded :class:`CausalLM`:
q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (rows concatenated, when the parts
share a type), ``o_proj``, ``down_proj``, the LM head, and the token embedding (a
:class:`QuantizedEmbedding` that dequantizes the rows it looks up). A module whose tensor is
another type (F32, F16, IQ*) keeps its float weight. :func:`install_gguf_linears` does that
to a model still on the meta device, before its float weights load; kernels whose ``linear``
takes quantized weights (``with_quantized_linear``) run it, and the decoder code is unchanged
(it passes ``module.weight`` to ``ops.linear``).

:mod:`inflight.runtime.model.quantization` decides when (``EngineConfig.quantization``).
Single-rank dense models only. Knows nothing about serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from inflight.kernels import cpu_quant, quant_reference
from inflight.kernels.quant_reference import BLOCK_BYTES, QuantizedWeight
from inflight.runtime.model.gguf_convert import check_supported, hf_tensor_name, unpermute_rows


@dataclass(frozen=True, slots=True)
class QuantizationSummary:
    """What :func:`quantize_model` did: modules swapped, kept float, and weight bytes."""

    num_quantized: int
    kept_float: tuple[str, ...]
    quantized_bytes: int  # the packed blocks now resident
    float32_bytes: int  # what the same weights take as float32


class QuantizedEmbedding(nn.Module):
    """An embedding table kept in GGUF blocks; looks rows up and dequantizes them."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        ids = input_ids.reshape(-1)
        if self.weight.blocks.device.type == "cpu":
            rows = cpu_quant.quant_embedding(ids, self.weight)
        else:
            rows = quant_reference.quant_embedding(ids, self.weight)
        return rows.to(self.dtype).reshape(*input_ids.shape, self.weight.in_features)


def read_quantized_weights(gguf_path: str | Path, device: torch.device | None = None) -> dict[str, QuantizedWeight]:
    """transformers name -> packed weight, for every 2-D tensor of a supported block type."""
    from inflight.runtime.model.gguf_index import open_gguf

    reader = open_gguf(gguf_path)
    info = check_supported(reader)
    out: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        name = hf_tensor_name(tensor.name)
        if qtype not in BLOCK_BYTES or name is None or len(tensor.shape) != 2:
            continue
        blocks = np.asarray(tensor.data, dtype=np.uint8)  # [rows, row_bytes]
        if tensor.name.endswith("attn_q.weight"):
            blocks = unpermute_rows(blocks, info.num_heads)
        elif tensor.name.endswith("attn_k.weight"):
            blocks = unpermute_rows(blocks, info.num_kv_heads)
        packed = torch.from_numpy(np.array(blocks, dtype=np.uint8, order="C", copy=True))
        out[name] = QuantizedWeight(qtype, packed if device is None else packed.to(device), int(tensor.shape[0]))
    return out


def _concat(parts: list[QuantizedWeight | None]) -> QuantizedWeight | None:
    if any(p is None for p in parts) or len({p.qtype for p in parts}) != 1:  # type: ignore[union-attr]
        return None
    first = parts[0]
    assert first is not None
    return QuantizedWeight(first.qtype, torch.cat([p.blocks for p in parts]), first.in_features)  # type: ignore[union-attr]


def _swap(linear: nn.Linear, weight: QuantizedWeight | None, name: str, summary: dict[str, Any]) -> None:
    if weight is None or tuple(weight.shape) != tuple(linear.weight.shape):
        summary["kept"].append(name)
        return
    summary["f32"] += linear.weight.numel() * 4
    summary["bytes"] += weight.nbytes
    summary["n"] += 1
    del linear.weight  # the Parameter goes; a plain attribute the decoder passes to ops.linear
    linear.weight = weight  # type: ignore[assignment]


def quantize_model(model: Any, weights: dict[str, QuantizedWeight],
                   dtype: torch.dtype | None = None) -> QuantizationSummary:
    """Swap ``weights`` into ``model`` (a single-rank :class:`CausalLM`, materialised or still
    on the meta device) in place; ``dtype``: what the packed embedding returns (default: the
    float embedding's dtype)."""
    if model.tp is not None or model.spec.moe is not None:
        raise ValueError("quantization=gguf serves single-rank dense models only (no tensor parallel, no MoE).")
    summary: dict[str, Any] = {"kept": [], "f32": 0, "bytes": 0, "n": 0}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _concat([weights.get(f"{pre}.self_attn.{p}_proj.weight") for p in "qkv"])
        _swap(attn.qkv_proj, qkv, f"{pre}.self_attn.qkv_proj", summary)
        _swap(attn.o_proj, weights.get(f"{pre}.self_attn.o_proj.weight"), f"{pre}.self_attn.o_proj", summary)
        gate_up = _concat([weights.get(f"{pre}.mlp.{p}_proj.weight") for p in ("gate", "up")])
        _swap(mlp.gate_up_proj, gate_up, f"{pre}.mlp.gate_up_proj", summary)
        _swap(mlp.down_proj, weights.get(f"{pre}.mlp.down_proj.weight"), f"{pre}.mlp.down_proj", summary)
    embed = weights.get("model.embed_tokens.weight")
    head = embed if model.spec.tie_word_embeddings else weights.get("lm_head.weight")
    dtype = dtype or model.embed_tokens.weight.dtype
    _swap(model.lm_head, head, "lm_head", summary)
    if embed is not None and tuple(embed.shape) == tuple(model.embed_tokens.weight.shape):
        if head is not embed:  # untied: the head's float weight was counted above, not the table
            summary["f32"] += embed.shape[0] * embed.shape[1] * 4
            summary["bytes"] += embed.nbytes
        model.embed_tokens = QuantizedEmbedding(embed, dtype)
    else:
        summary["kept"].append("model.embed_tokens")
    return QuantizationSummary(summary["n"], tuple(summary["kept"]), summary["bytes"], summary["f32"])


def install_gguf_linears(model: Any, gguf_path: str | Path, device: torch.device,
                         dtype: torch.dtype) -> frozenset[str]:
    """Put the GGUF file's packed weights into ``model`` while it is on the meta device, so
    their float copies are never made; returns the converted directory's tensor names that the
    loader must skip (the float versions of what is now packed)."""
    quantize_model(model, read_quantized_weights(gguf_path, device), dtype)
    skipped = set()
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}"
        parts = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",), "mlp.down_proj": ("mlp.down_proj",),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
        for fused, names in parts.items():
            if _is_packed(layer.get_submodule(fused).weight):
                skipped.update(f"{pre}.{n}.weight" for n in names)
    if isinstance(model.embed_tokens, QuantizedEmbedding):
        skipped.add("model.embed_tokens.weight")
    if _is_packed(model.lm_head.weight):
        skipped.add("lm_head.weight")
    return frozenset(skipped)


def _is_packed(weight: object) -> bool:
    return weight is not None and not isinstance(weight, torch.Tensor) and hasattr(weight, "nbytes")


def packed_weights(model: nn.Module) -> list[Any]:
    """Every packed weight ``model`` holds (GGUF blocks, compressed-tensors words), each once
    (a tied embedding and head share one)."""
    found = {id(w): w for m in model.modules() if _is_packed(w := m.__dict__.get("weight"))}
    return list(found.values())


def summarize_packed(model: nn.Module) -> QuantizationSummary:
    """What ``model`` holds packed (any packed weight type) and which linears stayed float."""
    packed = packed_weights(model)
    kept = tuple(n for n, m in model.named_modules() if isinstance(m, nn.Linear) and isinstance(m.weight, torch.Tensor))
    return QuantizationSummary(len(packed), kept, sum(w.nbytes for w in packed),
                               sum(w.shape[0] * w.shape[1] * 4 for w in packed))


def num_weights(model: nn.Module) -> int:
    """Weights the model multiplies by, float parameters and packed weights alike."""
    return sum(p.numel() for p in model.parameters()) + sum(w.shape[0] * w.shape[1] for w in packed_weights(model))


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer plus every packed weight the model holds."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values()) + sum(w.nbytes for w in packed_weights(model))
