"""An EAGLE-3 draft head (``"method": "eagle3"``): its config, its start-up checks, its weights and
its forward pass.

A head is one decoder layer trained beside a target model (Li et al., EAGLE-3, 2025). It reads
the target's hidden states entering three of its layers (low, mid, high: the config's
``eagle_aux_hidden_state_layer_ids``, at the top level or in ``eagle_config``; else vLLM's
default ``(2, L // 2, L - 3)``; id ``i`` is the residual stream entering layer ``i``, 0 the
embeddings; concatenated in layer order, as vLLM does), fused through ``fc`` (``3 * target_hidden ->
hidden``). At position ``p`` its
layer's input is the embedding of token ``p + 1`` (``input_layernorm``) beside the fused state
(``hidden_norm``), concatenated (attention's q/k/v read ``2 * hidden``); its MLP and final
``norm`` follow, and ``lm_head`` scores a draft vocabulary of ``draft_vocab_size`` tokens whose
``d2t`` offsets map draft id ``i`` to target id ``i + d2t[i]``. The state before the final norm
is what the head's next chained pass reads in place of the target's.

The published layout loads as it is (``EAGLE3-LLaMA3.1-Instruct-8B``: config.json with
``architectures: ["LlamaForCausalLMEagle3"]``, safetensors ``fc.weight``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``; ``layers.0.`` is read as ``midlayer.``, and
``embed_tokens.weight`` is optional: without it the head reads the target's embeddings). A head
that cannot serve beside the target (another hidden size or vocabulary, aux layers the target
lacks, missing or misshapen tensors) raises ``ValueError`` with the reason before it is used.
A pass of decode rows only (each chained draft; a decode step's catch-up) runs its attention block
as one kernel call where the bundle has one (``decode_attention_block``, as the served model's decode
does), bit for bit what the per-op path gives. Knows nothing about scheduling, KV blocks or sampling (:mod:`.eagle3` drives it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from inflight.kernels.ops import KernelOps
from inflight.runtime.config import EngineConfig
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.decode_paths import decode_rows
from inflight.runtime.model.decoder import MLP, Attention, RMSNorm
from inflight.runtime.model.layout import shard_layout
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import ModelSpec, spec_from_hf_config
from inflight.runtime.spec_decode.speculative import parse_speculative_config

HEAD_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
NUM_AUX_LAYERS = 3
# checkpoint name (after midlayer. / layers.0. -> layer.) -> (module, the fused parameter's part)
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """What an EAGLE-3 head's config.json says beyond its decoder layer's shape."""

    aux_layer_ids: tuple[int, ...]  # the target layers whose input hidden states the head reads
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool  # the fused state enters the residual stream after hidden_norm


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's choice when the head's config names none: low, middle and high layers."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def eagle3_head_dir(config: EngineConfig) -> Path | None:
    """The head's directory when ``config`` speculates with EAGLE-3, else None."""
    spec = parse_speculative_config(config.speculative_config)
    if spec is None or spec.method != "eagle3":
        return None
    assert spec.model is not None  # SpeculativeConfig requires it for eagle3
    return Path(spec.model).expanduser()


def check_eagle3_head(model_dir: str | Path, config: EngineConfig) -> None:
    """Raise ``ValueError`` unless the configured head can serve beside ``model_dir`` (configs only)."""
    head_dir = eagle3_head_dir(config)
    if head_dir is None:
        raise ValueError("check_eagle3_head: the speculative config names no EAGLE-3 head")
    read_head_config(head_dir, spec_from_hf_config(load_hf_config(model_dir)))


def read_head_config(head_dir: Path, target: ModelSpec) -> tuple[Any, ModelSpec, Eagle3Config]:
    """The head's transformers config, its layer's spec and its EAGLE-3 fields; ``ValueError``
    naming what to change when the head cannot serve beside ``target``."""
    where = f"the EAGLE-3 head in {head_dir}"
    if not (head_dir / "config.json").is_file():
        raise ValueError(f'speculative_config "model": {head_dir} is not an EAGLE-3 head directory (it needs '
                         "config.json and safetensors weights, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)")
    raw = json.loads((head_dir / "config.json").read_text())
    archs = list(raw.get("architectures") or [])
    if "transformer_layer_config" in raw or "speculators_config" in raw:
        raise ValueError(f"{where} is in the speculators format ({archs}); convert it to the EAGLE-3 layout "
                         f"({HEAD_ARCHITECTURES[0]}: config.json with the layer's fields at the top level)")
    if not any(a in HEAD_ARCHITECTURES for a in archs):
        raise ValueError(f"{where} is not an EAGLE-3 head: its config.json says architectures {archs}, not one "
                         f"of {', '.join(HEAD_ARCHITECTURES)}")
    from transformers import LlamaConfig

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    hf_config = LlamaConfig(**fields)
    hf_config.architectures = ["LlamaForCausalLM"]  # its one layer is a Llama layer
    spec = spec_from_hf_config(hf_config)
    if spec.num_layers != 1:
        raise ValueError(f"{where} has {spec.num_layers} layers; only one-layer heads are served")
    eagle = raw.get("eagle_config") or {}
    if not isinstance(eagle, dict):
        raise ValueError(f"{where}: eagle_config must be a JSON object")
    if eagle.get("use_aux_hidden_state") is False:
        raise ValueError(f"{where} reads no auxiliary hidden states (eagle_config.use_aux_hidden_state false): "
                         "an EAGLE-1/2 style head, which is not served")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    aux = tuple(ids) if ids else default_aux_layer_ids(target.num_layers)
    if len(aux) != NUM_AUX_LAYERS or len(set(aux)) != NUM_AUX_LAYERS or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < target.num_layers for i in aux):
        raise ValueError(f"{where} reads the hidden states of layers {list(aux)}"
                         + ("" if ids else " (vLLM's default for its layer count)") + f"; the served model has "
                         f"{target.num_layers} layers: eagle_aux_hidden_state_layer_ids must be three different ids "
                         f"in 0..{target.num_layers - 1}")
    target_hidden = int(raw.get("target_hidden_size") or spec.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(f"{where} was trained for a model of hidden size {target_hidden}; the served model's is "
                         f"{target.hidden_size}: this head belongs to another model")
    if spec.vocab_size != target.vocab_size:
        raise ValueError(f"{where} maps drafts into a vocabulary of {spec.vocab_size} tokens; the served model "
                         f"has {target.vocab_size}: this head belongs to another model")
    draft_vocab = int(raw.get("draft_vocab_size") or spec.vocab_size)
    if not 0 < draft_vocab <= spec.vocab_size:
        raise ValueError(f"{where}: draft_vocab_size {draft_vocab} must be in 1..vocab_size {spec.vocab_size}")
    return hf_config, spec, Eagle3Config(aux, draft_vocab, target_hidden, bool(raw.get("norm_before_residual")))


class Eagle3Head(nn.Module):
    """The head's modules (see module docstring); ``embed_tokens`` None: the target's are read."""

    def __init__(self, spec: ModelSpec, config: Eagle3Config, own_embeddings: bool) -> None:
        super().__init__()
        self.spec, self.config = spec, config
        hidden = spec.hidden_size
        layout = shard_layout(spec, 0, 1)
        self.embed_tokens = nn.Embedding(spec.vocab_size, hidden) if own_embeddings else None
        self.fc = nn.Linear(NUM_AUX_LAYERS * config.target_hidden_size, hidden, bias=False)
        self.self_attn = Attention(spec, layout, None, spec.layer_window(0))
        self.self_attn.qkv_proj = nn.Linear(2 * hidden, self.self_attn.qkv_proj.out_features, bias=spec.qkv_bias)
        self.mlp = MLP(spec, layout, None)
        self.input_layernorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, spec.rms_norm_eps)
        self.norm = RMSNorm(hidden, spec.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)
        self.identity_vocab = True  # the draft vocabulary is the target's, in its order (set by load_head)

    def forward(
        self,
        embeds: torch.Tensor,  # [num_tokens, hidden]: the embeddings of each position's next token
        hidden: torch.Tensor,  # [num_tokens, hidden]: fused target states, or the head's own pre-norm ones
        positions: torch.Tensor,  # [num_tokens]
        cos_sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (final-normed, pre-norm), each [num_tokens, hidden]
        x = ops.rms_norm(embeds, self.input_layernorm.weight, self.input_layernorm.eps)[0]
        normed = ops.rms_norm(hidden, self.hidden_norm.weight, self.hidden_norm.eps)[0]
        residual = normed if self.config.norm_before_residual else hidden
        # a pass of decode rows only (every chained pass; a decode step's catch-up) runs its
        # attention block as one kernel call where the bundle has one, as the target's decode does
        rows = decode_rows(positions, meta, ops)
        attn = self.self_attn(torch.cat([x, normed], dim=-1), positions, cos_sin, kv_cache, meta, ops, rows)
        norm = self.post_attention_layernorm
        x, residual = ops.rms_norm(attn, norm.weight, norm.eps, residual)
        out = self.mlp(x, ops)
        return ops.rms_norm(out, self.norm.weight, self.norm.eps, residual)

    def fuse(self, aux: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [num_tokens, hidden]
        """The target's aux states ``[num_tokens, 3 * target_hidden]`` through ``fc``."""
        return ops.linear(aux, self.fc.weight)

    def logits(self, normed: torch.Tensor, ops: KernelOps) -> torch.Tensor:  # [n, vocab] float32
        """Scores over the target's vocabulary: the draft vocabulary's through ``d2t``, -inf elsewhere."""
        draft = ops.linear(normed, self.lm_head.weight).float()
        if self.identity_vocab:
            return draft
        full = draft.new_full((draft.shape[0], self.spec.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = draft
        return full


def load_head(head_dir: Path, spec: ModelSpec, config: Eagle3Config, device: torch.device,
              dtype: torch.dtype) -> Eagle3Head:  # fmt: skip
    """The head's weights from ``head_dir``'s safetensors; ``ValueError`` naming a missing,
    unknown or misshapen tensor."""
    from safetensors.torch import load_file

    files = sorted(head_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"the EAGLE-3 head in {head_dir} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        tensors.update(load_file(str(path)))
    d2t = tensors.pop("d2t", None)
    tensors.pop("t2d", None)  # target -> draft membership: the d2t offsets say the same
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, value in tensors.items():
        key = name.removeprefix("model.").replace("midlayer.", "").replace("layers.0.", "")
        module = key.split(".")[-2] if key.count(".") >= 1 else ""
        if module in _FUSED:
            fused, part = _FUSED[module]
            parts.setdefault(key.replace(module, fused), {})[part] = value
        else:
            state[key] = value
    for key, pieces in parts.items():
        need = 3 if "qkv_proj" in key else 2
        if sorted(pieces) != list(range(need)):
            raise ValueError(f"the EAGLE-3 head in {head_dir} lacks part of {key} (it has {len(pieces)} of {need})")
        state[key] = torch.cat([pieces[i] for i in range(need)], dim=0)
    own_embeddings = "embed_tokens.weight" in state
    if not own_embeddings and spec.hidden_size != config.target_hidden_size:
        raise ValueError(f"the EAGLE-3 head in {head_dir} has hidden size {spec.hidden_size}, the served model "
                         f"{config.target_hidden_size}: such a head needs embed_tokens.weight of its own")
    with torch.device("meta"):
        head = Eagle3Head(spec, config, own_embeddings)
    wanted = {name: p.shape for name, p in head.named_parameters()}
    missing = sorted(set(wanted) - set(state))
    unknown = sorted(set(state) - set(wanted))
    if missing or unknown:
        raise ValueError(f"the EAGLE-3 head in {head_dir} does not have the published layout: "
                         + (f"missing {', '.join(missing)}" if missing else "")
                         + ("; " if missing and unknown else "") + (f"unknown {', '.join(unknown)}" if unknown else ""))
    for name, shape in wanted.items():
        if tuple(state[name].shape) != tuple(shape):
            raise ValueError(f"the EAGLE-3 head in {head_dir}: {name} is {list(state[name].shape)}, its config "
                             f"says {list(shape)}")
    head.load_state_dict(state, strict=False, assign=True)
    head.draft_to_target = _draft_to_target(d2t, config, spec, head_dir)
    head.identity_vocab = bool((head.draft_to_target == torch.arange(spec.vocab_size)).all()) if (
        config.draft_vocab_size == spec.vocab_size) else False
    return head.to(device=device, dtype=dtype).eval()


def _draft_to_target(d2t: torch.Tensor | None, config: Eagle3Config, spec: ModelSpec, head_dir: Path) -> torch.Tensor:
    """``[draft_vocab]`` int64: each draft id's target id (``i + d2t[i]``; the identity without d2t)."""
    base = torch.arange(config.draft_vocab_size)
    if d2t is None:
        if config.draft_vocab_size != spec.vocab_size:
            raise ValueError(f"the EAGLE-3 head in {head_dir} has a draft vocabulary of {config.draft_vocab_size} "
                             f"tokens but no d2t tensor mapping it into the {spec.vocab_size} of the served model")
        return base
    if tuple(d2t.shape) != (config.draft_vocab_size,):
        raise ValueError(f"the EAGLE-3 head in {head_dir}: d2t is {list(d2t.shape)}, expected "
                         f"[{config.draft_vocab_size}] (draft_vocab_size)")
    targets = base + d2t.to(torch.int64)
    if bool(((targets < 0) | (targets >= spec.vocab_size)).any()) or targets.unique().numel() != targets.numel():
        raise ValueError(f"the EAGLE-3 head in {head_dir}: d2t maps draft ids outside the served model's "
                         f"{spec.vocab_size} tokens or two onto one")
    return targets
