"""DeepSeek-V3 checkpoints: this rank's part of each latent-attention tensor, and the MTP layers.

The attention tensors (``layers.N.self_attn.*``) are read here, not by the loader's generic
splitter, whose head arithmetic is Llama's: ``q_b_proj`` (or ``q_proj``) and ``kv_b_proj`` are cut
by this rank's heads (``qk_nope + qk_rope`` rows a head; ``qk_nope + v`` rows a head), ``o_proj`` by
its heads' ``v_head_dim`` columns (its bias, added after the all-reduce, held by rank 0 only), and
the latent projections and norms (``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``) are whole on every rank. With ``rope_interleave`` (DeepSeek's layout, and
transformers' default) each head's rotary features come in pairs ``(2i, 2i + 1)``; our rotary kernels
rotate halves ``(i, i + R/2)``, so the roped rows of ``q_b_proj``/``q_proj`` and of
``kv_a_proj_with_mqa`` are permuted pairs -> halves as they load (the same permutation on queries
and keys leaves every score unchanged). The experts, router and shared expert load as GLM-4.5's do
(:mod:`.moe_weights`, the loader). The multi-token-prediction layers (``layers.{num_hidden_layers +
i}``, ``num_nextn_predict_layers`` of them) are not the served model's: its load skips them, with a
log line, and speculative method ``mtp`` loads the first as its drafter
(:mod:`inflight.runtime.spec_decode.mtp_head`, which reads its attention tensors through
:func:`read_attention_tensor` too). Knows nothing about scheduling or kernels.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from inflight.runtime.model.layout import ShardLayout
from inflight.runtime.model.spec_types import MlaSpec, ModelSpec

logger = logging.getLogger("inflight.model")


def read_attention_tensor(name: str, part: Any, spec: ModelSpec, layout: ShardLayout) -> torch.Tensor:
    """This rank's part of latent-attention tensor ``name`` (``layers.N.self_attn.<module>.<kind>``),
    rotary rows as halves; the whole tensor when its shape is not the expected one (the loader then
    names both shapes)."""
    mla = spec.mla
    assert mla is not None
    module, kind = name.split(".")[-2:]
    shape = tuple(part.get_shape())
    qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    per_head = {"q_b_proj": qk, "q_proj": qk, "kv_b_proj": mla.qk_nope_head_dim + mla.v_head_dim}
    if module in per_head and kind == "weight":
        rows = per_head[module]
        if shape[0] != spec.num_heads * rows:
            return part[:]
        start = layout.q_head_start * rows
        tensor = part[start : start + layout.num_heads * rows]
        return _halves(tensor, mla, rows) if module != "kv_b_proj" and mla.rope_interleave else tensor
    if module == "o_proj":
        if kind == "bias":
            full = part[:]
            return full if layout.rank == 0 else torch.zeros_like(full)
        if len(shape) != 2 or shape[1] != spec.num_heads * mla.v_head_dim:
            return part[:]
        start = layout.q_head_start * mla.v_head_dim
        return part[:, start : start + layout.num_heads * mla.v_head_dim]
    if module == "kv_a_proj_with_mqa" and mla.rope_interleave:
        tensor = part[:]
        if tensor.shape[0] != mla.kv_lora_rank + mla.qk_rope_head_dim:
            return tensor
        return _halves(tensor, mla, tensor.shape[0])
    return part[:]


def _halves(tensor: torch.Tensor, mla: MlaSpec, rows_per_head: int) -> torch.Tensor:
    """Each head's last ``qk_rope_head_dim`` rows (of ``rows_per_head``) reordered pairs -> halves:
    ``0, 2, 4, ..., 1, 3, 5, ...``; the other rows kept."""
    rope = mla.qk_rope_head_dim
    keep = rows_per_head - rope
    order = torch.cat([torch.arange(keep), keep + torch.arange(0, rope, 2), keep + torch.arange(1, rope, 2)])
    heads = tensor.shape[0] // rows_per_head
    index = (torch.arange(heads)[:, None] * rows_per_head + order[None, :]).reshape(-1)
    return tensor.index_select(0, index)


def is_mtp_layer(name: str, spec: ModelSpec) -> bool:
    """A multi-token-prediction layer's tensor (``layers.{i >= num_layers}``), skipped at load."""
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= spec.num_layers


def log_skipped_mtp(config: Any, num_skipped: int) -> None:
    """Say that the checkpoint's MTP layers were not loaded into the served model (and who reads them)."""
    declared = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if num_skipped or declared:
        logger.info("DeepSeek-V3: skipped %d tensors of the %d multi-token-prediction layer(s) "
                    "(num_nextn_predict_layers) in the served model; speculative method mtp drafts with them "
                    "(issue 53)", num_skipped, declared)  # fmt: skip
