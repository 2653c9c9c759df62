"""Tiny pooling checkpoints made locally, and transformers' answers on the same weights.

``make_embedding_model`` saves a seeded random bare decoder (transformers' ``AutoModel``:
``Qwen3Model``, ``LlamaModel``) beside the demo tokenizer, optionally with sentence-transformers'
``modules.json`` and ``1_Pooling/config.json`` and Matryoshka fields in config.json;
``make_reranker`` saves a ``*ForSequenceClassification`` with one label. ``reference_embedding``
and ``reference_logits`` are what transformers computes (``last_hidden_state`` pooled by hand;
the classifier's logits) for one prompt of token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from inflight.runtime.demo.model import make_demo_model

ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


def _base(out: Path, arch: str) -> tuple[Any, Any]:
    base = make_demo_model(out / "base", arch, "tiny")
    return transformers.AutoConfig.from_pretrained(base), transformers.AutoTokenizer.from_pretrained(base)


def make_embedding_model(out: Path, arch: str = "qwen3", seed: int = 1, st_pooling: str | None = None,
                         st_normalize: bool = True, config_fields: dict[str, Any] | None = None) -> Path:
    config, tokenizer = _base(out, arch)
    for key, value in (config_fields or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config, dtype=torch.float32)
    path = out / "embed"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if st_pooling is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if st_normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        modes = {mode: mode == ST_MODES[st_pooling] for mode in ST_MODES.values()}
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return path


def make_reranker(out: Path, arch: str = "qwen3", seed: int = 2, num_labels: int = 1) -> Path:
    config, tokenizer = _base(out, arch)
    config.num_labels = num_labels
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # logits well away from 0, so a wrong row shows
    path = out / "rerank"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reference_embedding(model_dir: Path, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]  # [num_tokens, hidden]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    if normalize:
        vector = torch.nn.functional.normalize(vector, dim=-1)
    return vector.numpy()


def reference_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def make_bert(out: Path, head: str = "none", seed: int = 3, st_pooling: str | None = None,
              family: str = "bert") -> Path:
    """A tiny BERT (``BertModel``, or ``BertForSequenceClassification`` with one label for
    ``head="score"``) on the demo tokenizer given BERT's pair template (``<s> A </s> B </s>``, the
    second text and its ``</s>`` of type 1) and ``<s>``/``</s>`` as its ``[CLS]``/``[SEP]``;
    ``family="xlm-roberta"``: an XLM-RoBERTa (one token type, RoBERTa's pair template)."""
    from tokenizers import processors

    _, tokenizer = _base(out, "llama")
    bos, eos = tokenizer.bos_token, tokenizer.eos_token
    roberta = family == "xlm-roberta"
    pair = f"{bos} $A {eos} {eos} $B {eos}" if roberta else f"{bos} $A {eos} $B:1 {eos}:1"
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=pair,
        special_tokens=[(bos, tokenizer.bos_token_id), (eos, tokenizer.eos_token_id)])
    tokenizer.cls_token, tokenizer.sep_token = bos, eos
    sizes = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, pad_token_id=tokenizer.pad_token_id, num_labels=1)
    if roberta:
        config = transformers.XLMRobertaConfig(**sizes, type_vocab_size=1,
                                               max_position_embeddings=256 + tokenizer.pad_token_id + 1)
        kinds = (transformers.XLMRobertaModel, transformers.XLMRobertaForSequenceClassification)
    else:
        config = transformers.BertConfig(**sizes, max_position_embeddings=256)
        kinds = (transformers.BertModel, transformers.BertForSequenceClassification)
    torch.manual_seed(seed)
    model = kinds[head == "score"](config).eval()
    path = out / f"{family}-{head}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if st_pooling is not None:
        (path / "modules.json").write_text(json.dumps([  # no Normalize module: vectors as pooled
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                   ST_MODES[st_pooling]: True}))
    return path


def bert_reference(model_dir: Path, first: str, second: str | None = None) -> tuple[list[int], np.ndarray]:
    """(the ids the tokenizer makes of the text or pair, transformers' answer): ``last_hidden_state``
    for a ``BertModel``, the logits for a classifier; token types as the tokenizer's template sets them."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    encoding = tokenizer.backend_tokenizer.encode(first, second)
    ids, types = torch.tensor([encoding.ids]), torch.tensor([encoding.type_ids])
    model = transformers.AutoModel.from_pretrained(model_dir) if second is None else (
        transformers.AutoModelForSequenceClassification.from_pretrained(model_dir))
    with torch.no_grad():
        out = model(input_ids=ids, token_type_ids=types)
    return encoding.ids, (out.last_hidden_state[0] if second is None else out.logits[0]).numpy()
