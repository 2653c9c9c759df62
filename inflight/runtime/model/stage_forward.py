"""One pipeline stage's forward over a packed batch (issue 54): the decoder's layer loop for a
:class:`~inflight.runtime.model.decoder.CausalLM` built with a ``stage`` (:mod:`.stages`).

The first stage embeds the token ids; a later stage starts from the previous stage's hidden
states and residual (``carried``, ``[2, num_tokens, hidden]``). Layers run one by one, over this
stage's KV cache (the one-call decode stack holds a whole model and is not used); the last stage
returns the final-normed hidden states, the others their hidden states and residual stacked
(Gemma 3's sandwich layers keep no residual: zeros), for the next stage. Same arithmetic as
:meth:`CausalLM.forward` layer for layer, so the stages together give the one-rank result.
Knows nothing about how activations travel between ranks.
"""

from __future__ import annotations

import torch

from inflight.kernels import fp8_kv
from inflight.kernels.ops import KernelOps
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.decode_paths import decode_rows
from inflight.runtime.model.decoder import CausalLM, run_mlp


def run_stage(
    model: CausalLM,
    input_ids: torch.Tensor,  # [num_tokens]
    positions: torch.Tensor,  # [num_tokens]
    cos_sin: torch.Tensor,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # this stage's layers only
    meta: AttentionMetadata,
    ops: KernelOps,
    carried: torch.Tensor | None = None,  # [2, num_tokens, hidden]: None on the first stage
) -> torch.Tensor:  # last stage: [num_tokens, hidden] final-normed; others: [2, num_tokens, hidden]
    stage, spec = model.stage, model.spec
    if stage is None:
        raise ValueError("run_stage runs a model built for a pipeline stage (CausalLM(..., stage=...))")
    if (carried is None) != stage.is_first:
        raise ValueError(f"stage {stage.index} {'takes' if stage.index else 'takes no'} carried activations")
    if carried is None:
        hidden = model.embed(input_ids)
        if spec.embed_scale is not None:
            hidden = hidden * torch.tensor(spec.embed_scale, dtype=hidden.dtype)
        residual: torch.Tensor | None = None
    else:
        hidden, residual = carried[0], (None if spec.sandwich_norms else carried[1])
    fp8 = bool(kv_caches) and fp8_kv.is_fp8(kv_caches[0][0].dtype)
    rows = None if fp8 or spec.arch == "llama4_text" else decode_rows(positions, meta, ops)
    for layer, kv_cache in zip(model.layers, kv_caches, strict=True):
        if spec.sandwich_norms:
            hidden = layer.sandwich_forward(hidden, positions, cos_sin, kv_cache, meta, ops, rows)
            continue
        norm = layer.input_layernorm
        x, residual = ops.rms_norm(hidden, norm.weight, norm.eps, residual)
        x = layer.self_attn(x, positions, cos_sin, kv_cache, meta, ops, rows)
        norm = layer.post_attention_layernorm
        x, residual = ops.rms_norm(x, norm.weight, norm.eps, residual)
        hidden = run_mlp(layer.mlp, x, ops, meta.token_slots)
    if stage.is_last:
        assert model.norm is not None
        return ops.rms_norm(hidden, model.norm.weight, model.norm.eps, residual)[0]
    return torch.stack([hidden, torch.zeros_like(hidden) if residual is None else residual])
