"""A BERT-family encoder (BERT, RoBERTa, XLM-RoBERTa: ``*Model``, ``*ForSequenceClassification``).

Bidirectional attention within each prompt (``torch``'s scaled-dot-product attention, one call
per prompt), absolute position and token-type embeddings, post-LayerNorm layers with an erf-GELU
MLP, and, for a classifier, BERT's pooler (dense + tanh on the ``[CLS]`` row) and ``classifier``,
or RoBERTa's classification head (``classifier.dense`` + tanh + ``classifier.out_proj`` on the
``<s>`` row). RoBERTa's positions start after its padding index (``padding_idx + 1``), as
transformers numbers a prompt without padding. No KV cache: a prompt is encoded whole, in one
step. Token types are not carried by the engine: for BERT they are read off the ids as its pair
template sets them (type 1 after the first ``[SEP]``); RoBERTa's are all 0. The module names
follow transformers', so a checkpoint's ``state_dict`` (``bert.`` / ``roberta.`` prefix dropped)
loads as it is (:func:`load_encoder`). Knows nothing about scheduling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

ROBERTA_MODEL_TYPES = ("roberta", "xlm-roberta")


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)


class _Output(nn.Module):
    def __init__(self, size_in: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(size_in, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)


class _Attention(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.self = _SelfAttention(hidden)
        self.output = _Output(hidden, hidden, eps)


class _Intermediate(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, inner)


class _Layer(nn.Module):
    def __init__(self, hidden: int, inner: int, eps: float) -> None:
        super().__init__()
        self.attention = _Attention(hidden, eps)
        self.intermediate = _Intermediate(hidden, inner)
        self.output = _Output(inner, hidden, eps)


class _Encoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.layer = nn.ModuleList(_Layer(config.hidden_size, config.intermediate_size, eps)
                                   for _ in range(config.num_hidden_layers))  # fmt: skip


class _Embeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class _Pooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)


class _RobertaHead(nn.Module):
    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, num_labels)


class BertEncoder(nn.Module):
    """See module docstring. ``head``: "none" (hidden states) or "score" (a classifier);
    ``roberta``: RoBERTa's position offset, token types and classification head."""

    def __init__(self, config: Any, head: str, sep_token_id: int | None, roberta: bool = False) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head = head
        self.sep_token_id = None if roberta else sep_token_id
        self.first_position = (config.pad_token_id + 1) if roberta else 0
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)
        self.pooler = _Pooler(config.hidden_size) if head == "score" and not roberta else None
        self.classifier: nn.Module | None = None
        if head == "score":
            self.classifier = (_RobertaHead(config.hidden_size, config.num_labels) if roberta
                               else nn.Linear(config.hidden_size, config.num_labels))  # fmt: skip

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] of 0 and 1
        """Type 1 after a prompt's first ``[SEP]`` (the second text of a pair), else 0."""
        if self.sep_token_id is None or self.embeddings.token_type_embeddings.num_embeddings < 2:
            return torch.zeros_like(input_ids)
        is_sep = (input_ids == self.sep_token_id).long()
        return ((torch.cumsum(is_sep, 0) - is_sep) > 0).long()

    def forward(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:  # each [n_i, hidden]
        """The last layer's hidden states of each prompt (whole prompts, token ids [n_i])."""
        out = []
        for ids in prompts:
            emb = self.embeddings
            positions = torch.arange(ids.shape[0], device=ids.device) + self.first_position
            x = emb.word_embeddings(ids) + emb.position_embeddings(positions) + emb.token_type_embeddings(
                self.token_types(ids))
            x = emb.LayerNorm(x)
            for layer in self.encoder.layer:
                x = self._layer(layer, x)
            out.append(x)
        return out

    def _layer(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:  # [n, hidden]
        n, hidden = x.shape
        attn = layer.attention.self
        heads = [proj(x).view(n, self.num_heads, hidden // self.num_heads).transpose(0, 1)
                 for proj in (attn.query, attn.key, attn.value)]  # each [heads, n, head_dim]
        ctx = F.scaled_dot_product_attention(*heads).transpose(0, 1).reshape(n, hidden)
        out = layer.attention.output
        x = out.LayerNorm(out.dense(ctx) + x)
        inner = F.gelu(layer.intermediate.dense(x))
        return layer.output.LayerNorm(layer.output.dense(inner) + x)

    def score(self, cls_rows: torch.Tensor) -> torch.Tensor:  # [n, num_labels]
        """A classifier's logits from the ``[CLS]`` rows [n, hidden]: BERT's pooler then its
        classifier, or RoBERTa's head (dense, tanh, out_proj)."""
        head = self.classifier
        if isinstance(head, _RobertaHead):
            return head.out_proj(torch.tanh(head.dense(cls_rows)))
        if self.pooler is None or head is None:
            raise RuntimeError("this encoder has no classifier head")
        return head(torch.tanh(self.pooler.dense(cls_rows)))


def load_encoder(model_dir: Path, config: Any, head: str, sep_token_id: int | None,
                 device: torch.device, dtype: torch.dtype) -> BertEncoder:
    """The encoder of ``model_dir`` (``model.safetensors``) on ``device`` in ``dtype``; RoBERTa's
    kind when ``config.model_type`` is ``roberta`` or ``xlm-roberta``."""
    if getattr(config, "hidden_act", "gelu") != "gelu":
        raise ValueError(f"unsupported BERT hidden_act {config.hidden_act!r}; only gelu is implemented.")
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError("only absolute position embeddings are implemented for BERT encoders.")
    path = model_dir / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"{model_dir} holds no model.safetensors (sharded encoders are not supported).")
    roberta = getattr(config, "model_type", "bert") in ROBERTA_MODEL_TYPES
    weights = {k.removeprefix("bert.").removeprefix("roberta."): v for k, v in load_file(str(path)).items()}
    model = BertEncoder(config, head, sep_token_id, roberta)
    if head == "none":
        weights = {k: v for k, v in weights.items() if not k.startswith("pooler.")}  # unused
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [m for m in missing if not m.endswith("position_ids")]
    unexpected = [u for u in unexpected if not u.endswith("position_ids")]
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not fit a BERT encoder: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.to(device=device, dtype=dtype).eval()
