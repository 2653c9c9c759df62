"""The tokenizer stored in a GGUF file, rebuilt as Hugging Face tokenizer files.

A GGUF file with ``tokenizer.ggml.model = gpt2`` holds a byte-level BPE vocabulary (tokens
already spelled in GPT-2's byte alphabet), its merges, per-token types (3: control, 4:
user-defined), the special token ids, and usually the chat template. This module builds the
same tokenizer with the ``tokenizers`` library, choosing the pre-tokenizer the way llama.cpp
does from ``tokenizer.ggml.pre``, and saves it with transformers' ``save_pretrained`` so
``AutoTokenizer`` loads it. Knows nothing about weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp's llama-bpe (Llama 3) split, used with a regex-free byte-level step after it.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt-2", "smollm", "llama-bpe", "llama3")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in ("default", "gpt-2"):
        return byte_level
    if pre == "smollm":  # llama.cpp: each digit alone, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    raise ValueError(
        f"unsupported GGUF pre-tokenizer {pre!r}; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}."
    )


def build_tokenizer(reader: Any) -> Any:
    """A transformers ``PreTrainedTokenizerFast`` equal to the file's tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r}; inflight converts byte-level BPE (gpt2) "
            "tokenizers only, not SentencePiece (llama) ones."
        )
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _CONTROL
    ])
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED
    ])
    special = _special_tokens(reader, tokens)
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and "bos_token" in special:
        bos = special["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    template = _field(reader, "tokenizer.chat_template")
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **special)


def _special_tokens(reader: Any, tokens: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for role in ("bos", "eos", "unknown", "padding"):
        idx = _field(reader, f"tokenizer.ggml.{role}_token_id")
        if idx is not None and 0 <= int(idx) < len(tokens):
            name = {"unknown": "unk", "padding": "pad"}.get(role, role)
            out[f"{name}_token"] = tokens[int(idx)]
    return out


def write_tokenizer(reader: Any, out_dir: Path) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into ``out_dir``."""
    build_tokenizer(reader).save_pretrained(str(out_dir))
