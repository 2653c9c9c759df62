"""Qwen3-Next's multi-token-prediction layer (``mtp.*``) as a draft head (``"method": "mtp"``).

Qwen3-Next checkpoints carry one MTP layer beside the model, named (as vLLM's ``Qwen3NextMTP``
reads them) ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden`` (RMSNorms), ``mtp.fc``
(``[hidden, 2 * hidden]``), ``mtp.layers.0.*`` (a decoder layer of the model with gated full
attention, and the model's expert layer, or a dense MLP when the checkpoint has no experts there)
and ``mtp.norm``; it has no embedding or LM head of its own (the served model's are read).
At position ``p`` the layer reads the embedding of token ``p + 1`` through ``pre_fc_norm_embedding``
and the served model's final-normed output at ``p`` through ``pre_fc_norm_hidden``; ``fc`` of the two
concatenated (embedding first) enters the decoder layer, ``norm`` closes it, and the served model's
LM head scores the token at ``p + 2``. The normed output is also what the next chained pass reads
in place of the served model's (vLLM's ``Qwen3NextMultiTokenPredictor`` does the same). Every norm
scales by ``1 + weight`` (folded in at load, as for the served model).

:class:`Qwen3NextMtpHead` answers the calls :class:`~.mtp.MtpProposer` makes of a head
(``fuse``, ``forward``, ``logits``, ``embed_tokens``, ``spec``, ``config``). Only the first layer
is served (the published checkpoints have one). Knows nothing about scheduling or KV blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inflight.kernels.ops import KernelOps
from inflight.runtime.model import moe_weights
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.decoder import RMSNorm
from inflight.runtime.model.layout import shard_layout
from inflight.runtime.model.loader import _FUSED, _slices, checkpoint_tensors
from inflight.runtime.model.qwen3_next import Qwen3NextLayer
from inflight.runtime.model.spec import ModelSpec, spec_from_hf_config
from inflight.runtime.spec_decode.mtp_head import QWEN3_NEXT_LAYER as LAYER
from inflight.runtime.spec_decode.mtp_head import MtpConfig, check_mtp_checkpoint, checkpoint_names

PREFIX = "mtp."


class Qwen3NextMtpHead(nn.Module):
    """The served MTP layer as :class:`~.mtp.MtpProposer` drives a head (see module docstring)."""

    embed_tokens = None  # the served model's table is read

    def __init__(self, spec: ModelSpec, config: MtpConfig) -> None:
        super().__init__()
        self.spec, self.config = spec, config
        self.layout = shard_layout(spec, 0, 1)
        hidden = spec.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(hidden, spec.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, spec.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Qwen3NextLayer(spec, self.layout, None, 0)])
        self.norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.lm_head_weight: torch.Tensor | None = None  # [vocab, hidden]: the served model's (set at load)
        self.final_norm: tuple[torch.Tensor, float] | None = None  # the served model's (weight, eps), set at load

    def fuse(self, aux: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [num_tokens, hidden]
        """The served model's state as the layer reads it: its final norm over the pre-norm output."""
        assert self.final_norm is not None, "the MTP head's view of the served model's final norm was never set"
        return ops.rms_norm(aux, *self.final_norm)[0]

    def forward(
        self,
        embeds: torch.Tensor,  # [num_tokens, hidden]: the embeddings of each position's next token
        hidden: torch.Tensor,  # [num_tokens, hidden]: the served model's normed states, or the layer's own
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (normed for the LM head, what the next pass reads): the same
        e = ops.rms_norm(embeds, self.pre_fc_norm_embedding.weight, self.pre_fc_norm_embedding.eps)[0]
        h = ops.rms_norm(hidden, self.pre_fc_norm_hidden.weight, self.pre_fc_norm_hidden.eps)[0]
        x = ops.linear(torch.cat([e, h], dim=-1), self.fc.weight)
        layer = self.layers[0]
        norm = layer.input_layernorm
        y, residual = ops.rms_norm(x, norm.weight, norm.eps)
        y = layer.self_attn(y, positions, cos_sin, kv_cache, meta, ops)
        norm = layer.post_attention_layernorm
        y, residual = ops.rms_norm(y, norm.weight, norm.eps, residual)
        y = layer.mlp(y, ops)
        out = ops.rms_norm(y, self.norm.weight, self.norm.eps, residual)[0]
        return out, out

    def logits(self, normed: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [n, vocab] float32
        assert self.lm_head_weight is not None, "the MTP head's LM head was never set"
        return ops.linear(normed, self.lm_head_weight).float()


def mtp_spec(spec: ModelSpec, sparse: bool) -> ModelSpec:
    """The served model's spec for its MTP layer (index 0): full attention; the expert layer when the
    checkpoint has experts there (``sparse``), else the dense MLP."""
    moe = spec.moe
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=(0,) if sparse else ())
    return dataclasses.replace(spec, linear_attention=None, moe=moe)


def load_qwen3_next_mtp_head(model_dir: str | Path, hf_config: Any, device: torch.device,
                             dtype: torch.dtype) -> Qwen3NextMtpHead:  # fmt: skip
    """The MTP layer's weights from ``model_dir``'s checkpoint; ``ValueError`` naming a missing,
    unknown or misshapen tensor."""
    mtp = check_mtp_checkpoint(model_dir, hf_config)
    sparse = any(n.startswith(f"{LAYER}mlp.experts.") for n in checkpoint_names(model_dir))
    spec = mtp_spec(spec_from_hf_config(hf_config), sparse)
    if sparse and spec.moe is None:
        raise ValueError(f"the MTP layer in {model_dir} has experts but the model's config declares none")
    with torch.device("meta"):
        head = Qwen3NextMtpHead(spec, mtp)
    head = head.to_empty(device=device).to(dtype)
    params = dict(head.named_parameters())
    loaded: set[str] = set()
    for hf_name, part in checkpoint_tensors(model_dir):
        if not hf_name.startswith(PREFIX) or hf_name.startswith("mtp.layers.") and not hf_name.startswith(LAYER):
            continue
        name = hf_name.removeprefix(PREFIX).replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        dest, tensor, key = _destination(name, part, params, head)
        if dest.shape != tensor.shape:
            raise ValueError(f"MTP layer tensor {hf_name}: shape {list(tensor.shape)}, expected {list(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor.to(dtype))
        loaded.add(key)
    _check_complete(head, loaded, model_dir)
    with torch.no_grad():  # every norm here scales by (1 + weight), as the served model's (model/loader.py)
        for module in head.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(1.0)
    return head.eval()


def _destination(name: str, part: Any, params: dict[str, nn.Parameter],
                 head: Qwen3NextMtpHead) -> tuple[torch.Tensor, torch.Tensor, str]:  # fmt: skip
    """(our parameter's view, the checkpoint tensor read for it, what the completeness check records)."""
    spec = head.spec
    piece = moe_weights.expert_piece(name) if spec.moe is not None else None
    if piece is not None:
        if piece.target not in params:
            raise ValueError(f"MTP layer tensor mtp.{name!r} does not fit the Qwen3-Next layer")
        tensor = moe_weights.read_piece(name, piece, part, spec, head.layout)
        return moe_weights.destination(params[piece.target], piece), tensor, piece.key
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, index = _FUSED[parts[-2]]
        target = ".".join([*parts[:-2], fused, parts[-1]])
        if target not in params:
            raise ValueError(f"MTP layer tensor mtp.{name!r} does not fit the Qwen3-Next layer")
        rows = _slices(spec, head.layout, fused, name)[index]
        return params[target][rows[0] : rows[1]], part[:], f"{target}:{rows}"
    if name not in params:
        raise ValueError(f"MTP layer tensor mtp.{name!r} does not fit the Qwen3-Next layer")
    return params[name], part[:], name


def _check_complete(head: Qwen3NextMtpHead, loaded: Iterable[str], model_dir: str | Path) -> None:
    names = {key.split(":")[0] for key in loaded}
    missing = [n for n, _ in head.named_parameters() if n not in names and ".mlp.experts." not in n]
    spec = head.spec
    if spec.moe is not None and spec.moe.sparse_layers:
        missing += moe_weights.missing_pieces(spec, set(loaded))
    if missing:
        raise ValueError(f"the MTP layer in {model_dir} lacks {len(missing)} tensor(s): "
                         f"{', '.join('mtp.' + m for m in missing[:4])}")  # fmt: skip
