"""The tokenizer stored in a GGUF file, rebuilt as Hugging Face tokenizer files.

A GGUF file with ``tokenizer.ggml.model = gpt2`` holds a byte-level BPE vocabulary (tokens
already spelled in GPT-2's byte alphabet), its merges, per-token types (3: control, 4:
user-defined), the special token ids, and usually the chat template. This module builds the
same tokenizer with the ``tokenizers`` library, choosing the pre-tokenizer the way llama.cpp
does from ``tokenizer.ggml.pre``, and saves it with transformers' ``save_pretrained`` so
``AutoTokenizer`` loads it. The arrays' kinds and lengths are checked before they are read (as
many tokens as the embedding has rows, a type per token), and every value's kind after, so a
malformed tokenizer is one ``GGUFError`` line naming its key. Knows nothing about weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inflight.runtime.model.gguf_checks import GGUFError, shown
from inflight.runtime.model.gguf_info import field_value, source_path

_CONTROL, _USER_DEFINED = 3, 4
_STRING_TYPE = 8  # GGUF value types
_INT_TYPES = (0, 1, 2, 3, 4, 5, 10, 11)

# llama.cpp's llama-bpe (Llama 3) split, used with a regex-free byte-level step after it.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt-2", "smollm", "llama-bpe", "llama3")


def _field(reader: Any, key: str, kind: type, default: Any = None, *, array: bool = False) -> Any:
    """``key``'s value, a ``kind`` (``array``: a list of them), or ``default`` when absent."""
    value = field_value(reader, key)
    if value is None:
        return default
    ok = isinstance(value, list) and all(_is(v, kind) for v in value) if array else _is(value, kind)
    if not ok:
        raise GGUFError(source_path(reader), key, f"must be {'an array of ' if array else 'a '}{kind.__name__}")
    return value


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def check_arrays(reader: Any, vocab_size: int) -> None:
    """The tokenizer's arrays are of the right kind and length, checked before any is read:
    ``vocab_size`` tokens (the embedding's rows), a type per token, merges as strings."""
    arrays = getattr(reader, "arrays", None)
    if arrays is None:  # GGUFReader-like: its arrays are read already
        return
    path = source_path(reader)
    tokens = arrays.get("tokenizer.ggml.tokens")
    if tokens is None or tokens.item_type != _STRING_TYPE:
        raise GGUFError(path, "tokenizer.ggml.tokens", "missing or not an array of strings")
    if tokens.count != vocab_size:
        raise GGUFError(path, "tokenizer.ggml.tokens", f"{tokens.count} tokens, but the embedding "
                        f"(token_embd.weight) has {vocab_size} rows")
    merges = arrays.get("tokenizer.ggml.merges")
    if merges is not None and merges.item_type != _STRING_TYPE:
        raise GGUFError(path, "tokenizer.ggml.merges", "not an array of strings")
    types = arrays.get("tokenizer.ggml.token_type")
    if types is not None and (types.item_type not in _INT_TYPES or types.count != tokens.count):
        raise GGUFError(path, "tokenizer.ggml.token_type", f"must be {tokens.count} integers, one per token")


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
        f"unsupported GGUF pre-tokenizer {shown(pre)}; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}."
    )


def build_tokenizer(reader: Any) -> Any:
    """A transformers ``PreTrainedTokenizerFast`` equal to the file's tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = _field(reader, "tokenizer.ggml.model", str)
    if kind != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {shown(kind) if kind else None}; inflight converts byte-level "
            "BPE (gpt2) tokenizers only, not SentencePiece (llama) ones."
        )
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens", str, array=True))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", str, [], array=True)]
    if any(len(m) != 2 for m in merges):
        raise GGUFError(source_path(reader), "tokenizer.ggml.merges", "a merge without a space between its two parts")
    types = list(_field(reader, "tokenizer.ggml.token_type", int, [1] * len(tokens), array=True))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise GGUFError(source_path(reader), "tokenizer.ggml.merges", f"refused by the tokenizers library ({exc})") from exc
    tok.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", str, "default"))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _CONTROL
    ])
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED
    ])
    special = _special_tokens(reader, tokens)
    if _field(reader, "tokenizer.ggml.add_bos_token", bool, False) and "bos_token" in special:
        bos = special["bos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    template = _field(reader, "tokenizer.chat_template", str)
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **special)


def _special_tokens(reader: Any, tokens: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for role in ("bos", "eos", "unknown", "padding"):
        idx = _field(reader, f"tokenizer.ggml.{role}_token_id", int)
        if idx is not None and 0 <= idx < len(tokens):
            name = {"unknown": "unk", "padding": "pad"}.get(role, role)
            out[f"{name}_token"] = tokens[int(idx)]
    return out


def write_tokenizer(reader: Any, out_dir: Path, vocab_size: int) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into ``out_dir``;
    the file must hold ``vocab_size`` tokens (the embedding's rows)."""
    check_arrays(reader, vocab_size)
    try:
        tokenizer = build_tokenizer(reader)
    except ValueError:
        raise
    except Exception as exc:  # the tokenizers library raises a bare Exception for what it refuses
        raise GGUFError(source_path(reader), "tokenizer.ggml.tokens", f"refused by the tokenizers library ({exc})") from exc
    tokenizer.save_pretrained(str(out_dir))
