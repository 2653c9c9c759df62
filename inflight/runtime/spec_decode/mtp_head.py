"""A checkpoint's multi-token-prediction (MTP) layer as a draft head (``"method": "mtp"``): which
served models have one, its start-up checks, its weights and its forward pass.

DeepSeek-V3 (``DeepseekV3ForCausalLM``) and GLM-4.5 (``Glm4MoeForCausalLM``) checkpoints carry
``num_nextn_predict_layers`` MTP layers after their last decoder layer, named as decoder layers
``model.layers.{num_hidden_layers + i}.*`` (DeepSeek-V3's paper, section 2.2; vLLM's
``DeepSeekMTP`` and ``Glm4MoeMTP`` read the same names). Each is one full decoder layer of the model
(``self_attn``: latent attention or GQA with partial rotary; ``mlp``: the expert layer; the two
layer norms) with, beside it, ``enorm`` and ``hnorm`` (RMSNorms), ``eh_proj`` (``[hidden, 2 * hidden]``),
``shared_head.norm`` and ``shared_head.head`` (``[vocab, hidden]``), and ``embed_tokens``. At position
``p`` the layer reads the embedding of token ``p + 1`` (zero at position 0, as vLLM does) through
``enorm`` and the served model's output at ``p`` (its last layer's output after its final norm, the
state vLLM's and SGLang's MTP proposers and Megatron's MTP training hand the layer) through ``hnorm``,
``eh_proj`` of the two concatenated enters the decoder layer, and ``shared_head.norm`` then
``shared_head.head`` score the token at ``p + 2``. The state before ``shared_head.norm`` is what the
next chained pass reads in place of the served model's (vLLM reuses the layer recursively the same
way). ``embed_tokens`` and ``shared_head.head`` are copies of the served model's in the published
checkpoints; a checkpoint without them reads the served model's own.

Only the first MTP layer is served: every draft comes from it (all published checkpoints have one;
a second layer would need its own KV of every position, fed from the first's outputs), said in the
log when there are more. The layer is whole (unsharded) and runs on rank 0 under tensor parallelism.
Qwen3-Next's ``mtp.*`` layer is laid out otherwise (:mod:`.qwen3_next_mtp` is its head; its
start-up check is here). Any other family is refused with the reason, and so is a config or
checkpoint without MTP layers (transformers' ``save_pretrained`` drops them). Knows nothing about
scheduling or KV blocks (:mod:`.mtp` drives it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inflight.kernels.ops import KernelOps
from inflight.runtime.config import EngineConfig
from inflight.runtime.model import deepseek_v3, moe_weights
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.decoder import DecoderLayer, RMSNorm, run_mlp
from inflight.runtime.model.layout import shard_layout
from inflight.runtime.model.loader import _FUSED, _slices, checkpoint_tensors, load_hf_config
from inflight.runtime.model.spec import ModelSpec, spec_from_hf_config
from inflight.runtime.spec_decode.speculative import parse_speculative_config

logger = logging.getLogger("inflight.loading")

MTP_ARCHS = {"deepseek_v3": "DeepSeek-V3", "glm4_moe": "GLM-4.5", "qwen3_next": "Qwen3-Next"}
QWEN3_NEXT_LAYER = "mtp.layers.0."  # Qwen3-Next's MTP layer (spec_decode/qwen3_next_mtp.py)
OPTIONAL = ("embed_tokens.weight", "shared_head.head.weight")  # the served model's own are read when absent


@dataclass(frozen=True, slots=True)
class MtpConfig:
    """What the served model's config says about its MTP layers."""

    num_nextn_predict_layers: int
    first_layer: int  # the checkpoint index of the served layer: num_hidden_layers

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target state the layer reads (:class:`~inflight.runtime.model.aux_hidden.AuxHidden`): the
        last layer's output before the final norm."""
        return (self.first_layer,)


def read_mtp_config(hf_config: Any, spec: ModelSpec) -> MtpConfig:
    """The served model's MTP layers; ``ValueError`` saying why when it has none that can draft."""
    if spec.arch == "qwen3_next":  # its config may not say (the checkpoint's names do: check_mtp_checkpoint)
        declared = getattr(hf_config, "num_nextn_predict_layers", None) or getattr(hf_config, "mtp_num_hidden_layers",
                                                                                   None)  # fmt: skip
        return MtpConfig(declared if isinstance(declared, int) and declared > 0 else 1, spec.num_layers)
    if spec.arch not in MTP_ARCHS:
        archs = list(getattr(hf_config, "architectures", None) or [spec.arch])
        raise ValueError(f"speculative method mtp reads the multi-token-prediction layers of DeepSeek-V3 "
                         f"(DeepseekV3ForCausalLM), GLM-4.5 (Glm4MoeForCausalLM) and Qwen3-Next (Qwen3NextForCausalLM) "
                         f"checkpoints; the served model is {', '.join(archs)}, which has none: use method ngram, "
                         "draft_model or eagle3")
    declared = getattr(hf_config, "num_nextn_predict_layers", None)
    if not isinstance(declared, int) or isinstance(declared, bool) or declared < 1:
        raise ValueError(f"speculative method mtp: the served {MTP_ARCHS[spec.arch]} model declares no "
                         f"multi-token-prediction layers (config.json num_nextn_predict_layers {declared!r}); "
                         "serve a checkpoint that has them, or use method ngram")
    return MtpConfig(declared, spec.num_layers)


def mtp_layer_spec(hf_config: Any, mtp: MtpConfig) -> ModelSpec:
    """The served model's spec counting its MTP layers as decoder layers, so the spec's per-layer
    choices (the expert layers from ``first_k_dense_replace`` on) cover them as vLLM's do."""
    extended = copy.deepcopy(hf_config)
    extended.num_hidden_layers = mtp.first_layer + mtp.num_nextn_predict_layers
    return spec_from_hf_config(extended)


def uses_mtp(config: EngineConfig) -> bool:
    """Whether ``config`` speculates with the served model's MTP layers."""
    spec = parse_speculative_config(config.speculative_config)
    return spec is not None and spec.method == "mtp"


def check_mtp(model_dir: str | Path, config: EngineConfig) -> None:
    """``ValueError`` unless the served model has an MTP layer to draft with, when ``config`` asks for
    one (``inflight serve``'s preflight: its config and its checkpoint's tensor names, no weight read)."""
    if uses_mtp(config):
        check_mtp_checkpoint(model_dir, load_hf_config(model_dir))


def check_mtp_checkpoint(model_dir: str | Path, hf_config: Any) -> MtpConfig:
    """``ValueError`` unless the served model has an MTP layer to draft with, in its config and among
    its checkpoint's tensors (names only: no weight is read)."""
    spec = spec_from_hf_config(hf_config)
    mtp = read_mtp_config(hf_config, spec)
    if spec.arch == "qwen3_next":
        names = set(checkpoint_names(model_dir))
        if "mtp.fc.weight" not in names or not any(n.startswith(QWEN3_NEXT_LAYER) for n in names):
            raise ValueError(f"speculative method mtp: the Qwen3-Next checkpoint in {model_dir} has no MTP layer "
                             "(mtp.fc, mtp.layers.0.*); it was saved without it (transformers' save_pretrained drops "
                             "mtp.*): serve the published checkpoint, or use method ngram")  # fmt: skip
        return mtp
    prefix = f"layers.{mtp.first_layer}."
    if not any(name.removeprefix("model.").startswith(prefix) for name in checkpoint_names(model_dir)):
        raise ValueError(f"speculative method mtp: config.json declares num_nextn_predict_layers "
                         f"{mtp.num_nextn_predict_layers} but the checkpoint in {model_dir} has no tensor of its "
                         f"first MTP layer (model.layers.{mtp.first_layer}.*); it was saved without them "
                         "(transformers' save_pretrained drops them): serve the published checkpoint")
    if mtp.num_nextn_predict_layers > 1:
        logger.info("MTP: the checkpoint has %d MTP layers; every draft comes from the first "
                    "(model.layers.%d), the others are not loaded", mtp.num_nextn_predict_layers, mtp.first_layer)
    return mtp


def checkpoint_names(model_dir: str | Path) -> Iterable[str]:
    """The checkpoint's tensor names: a sharded checkpoint's index, else the file's header."""
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"].keys()
    return (name for name, _ in checkpoint_tensors(model_dir))


class SharedHead(nn.Module):
    """``shared_head``: the final norm and the LM head (None: the served model's is read)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.head: nn.Linear | None = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)


class MtpLayer(DecoderLayer):
    """One MTP layer: the decoder layer's modules under the checkpoint's names, and the MTP ones."""

    def __init__(self, spec: ModelSpec, index: int) -> None:
        super().__init__(spec, shard_layout(spec, 0, 1), None, index)
        hidden = spec.hidden_size
        self.enorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(spec)
        # given its table, nn.Embedding skips its random init (slow on the meta device)
        self.embed_tokens: nn.Embedding | None = nn.Embedding(spec.vocab_size, hidden,
                                                              _weight=torch.empty(spec.vocab_size, hidden))


class MtpHead(nn.Module):
    """The served MTP layer as the proposer drives a head (:class:`~.eagle3.Eagle3Proposer`'s calls)."""

    def __init__(self, spec: ModelSpec, config: MtpConfig) -> None:
        super().__init__()
        self.spec, self.config = spec, config
        self.layout = shard_layout(spec, 0, 1)
        self.layers = nn.ModuleDict({str(config.first_layer): MtpLayer(spec, config.first_layer)})
        self.lm_head_weight: torch.Tensor | None = None  # [vocab, hidden]: the served model's, without shared_head.head
        self.final_norm: tuple[torch.Tensor, float] | None = None  # the served model's (weight, eps), set at load

    @property
    def layer(self) -> MtpLayer:
        return self.layers[str(self.config.first_layer)]  # type: ignore[return-value]

    @property
    def embed_tokens(self) -> nn.Embedding | None:
        """The layer's own embedding table; None: the served model's is read."""
        return self.layer.embed_tokens

    def fuse(self, aux: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [num_tokens, hidden]
        """The served model's state as the layer reads it: its final norm over the last layer's
        output (one state, no ``fc``), as vLLM and SGLang hand the model's output to the layer."""
        assert self.final_norm is not None, "the MTP head's view of the served model's final norm was never set"
        return ops.rms_norm(aux, *self.final_norm)[0]

    def forward(
        self,
        embeds: torch.Tensor,  # [num_tokens, hidden]: the embeddings of each position's next token
        hidden: torch.Tensor,  # [num_tokens, hidden]: the served model's final-normed states, or the layer's own
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (shared_head-normed, pre-norm), each [num_tokens, hidden]
        layer = self.layer
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)  # vLLM: position 0's embedding unused
        e = ops.rms_norm(embeds, layer.enorm.weight, layer.enorm.eps)[0]
        h = ops.rms_norm(hidden, layer.hnorm.weight, layer.hnorm.eps)[0]
        x = ops.linear(torch.cat([e, h], dim=-1), layer.eh_proj.weight)
        norm = layer.input_layernorm
        y, residual = ops.rms_norm(x, norm.weight, norm.eps)
        y = layer.self_attn(y, positions, cos_sin, kv_cache, meta, ops)
        norm = layer.post_attention_layernorm
        y, residual = ops.rms_norm(y, norm.weight, norm.eps, residual)
        y = run_mlp(layer.mlp, y, ops, None)
        norm = layer.shared_head.norm
        return ops.rms_norm(y, norm.weight, norm.eps, residual)

    def logits(self, normed: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [n, vocab] float32
        head = self.layer.shared_head.head
        weight = head.weight if head is not None else self.lm_head_weight
        assert weight is not None, "the MTP head's LM head was never set"
        return ops.linear(normed, weight).float()


def load_mtp_head(model_dir: str | Path, hf_config: Any, device: torch.device, dtype: torch.dtype) -> MtpHead:
    """The first MTP layer's weights from ``model_dir``'s checkpoint; ``ValueError`` naming a missing,
    unknown or misshapen tensor. ``embed_tokens`` / ``shared_head.head`` are None when absent."""
    mtp = check_mtp_checkpoint(model_dir, hf_config)
    spec = mtp_layer_spec(hf_config, mtp)
    with torch.device("meta"):
        head = MtpHead(spec, mtp)
    head = head.to_empty(device=device).to(dtype)
    params = dict(head.named_parameters())
    prefix = f"layers.{mtp.first_layer}."
    loaded: set[str] = set()
    for hf_name, part in checkpoint_tensors(model_dir):
        name = hf_name.removeprefix("model.")
        if not name.startswith(prefix) or "rotary_emb" in name:
            continue
        dest, tensor, key = _destination(name, part, params, head)
        if dest.shape != tensor.shape:
            raise ValueError(f"MTP layer tensor {hf_name}: shape {list(tensor.shape)}, expected {list(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor.to(dtype))
        loaded.add(key)
    _check_complete(head, loaded, prefix, model_dir)
    layer = head.layer
    if f"{prefix}embed_tokens.weight" not in loaded:
        layer.embed_tokens = None
    if f"{prefix}shared_head.head.weight" not in loaded:
        layer.shared_head.head = None
    return head.eval()


def _destination(name: str, part: Any, params: dict[str, nn.Parameter],
                 head: MtpHead) -> tuple[torch.Tensor, torch.Tensor, str]:  # fmt: skip
    """(our parameter's view, the checkpoint tensor read for it, what the completeness check records)."""
    spec, layout = head.spec, head.layout
    piece = moe_weights.expert_piece(name) if spec.moe is not None else None
    if piece is not None:
        if piece.target not in params:
            raise ValueError(f"MTP layer tensor {name!r} does not fit the {spec.arch} layer")
        tensor = moe_weights.read_piece(name, piece, part, spec, layout)
        return moe_weights.destination(params[piece.target], piece), tensor, piece.key
    parts = name.split(".")
    mla_attention = spec.mla is not None and ".self_attn." in name
    if len(parts) >= 2 and parts[-2] in _FUSED and not mla_attention:
        fused, index = _FUSED[parts[-2]]
        target = ".".join([*parts[:-2], fused, parts[-1]])
        if target not in params:
            raise ValueError(f"MTP layer tensor {name!r} does not fit the {spec.arch} layer")
        rows = _slices(spec, layout, fused, name)[index]
        return params[target][rows[0] : rows[1]], part[:], f"{target}:{rows}"
    if name not in params:
        raise ValueError(f"MTP layer tensor {name!r} does not fit the {spec.arch} layer")
    tensor = deepseek_v3.read_attention_tensor(name, part, spec, layout) if mla_attention else part[:]
    return params[name], tensor, name


def _check_complete(head: MtpHead, loaded: set[str], prefix: str, model_dir: str | Path) -> None:
    names = {key.split(":")[0] for key in loaded}
    missing = [n for n, _ in head.named_parameters() if n not in names and n.removeprefix(prefix) not in OPTIONAL
               and ".mlp.experts." not in n]  # fmt: skip
    spec = head.spec
    if spec.moe is not None and head.config.first_layer in spec.moe.sparse_layers:
        only = dataclasses.replace(spec.moe, sparse_layers=(head.config.first_layer,))
        missing += moe_weights.missing_pieces(dataclasses.replace(spec, moe=only), loaded)
    if missing:
        raise ValueError(f"the MTP layer in {model_dir} lacks {len(missing)} tensor(s): "
                         f"{', '.join('model.' + m for m in missing[:4])}")
