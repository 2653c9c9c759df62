"""Tokenizer loading and the end-of-sequence ids, read from a local model directory.

A tokenizer loads as ``AutoTokenizer`` loads it. ``AutoTokenizer`` reads the model's config
to choose the tokenizer class, and transformers' config classes import torch; the tokenizer
classes do not. So a process told the class that ``AutoTokenizer`` chose (its
:func:`tokenizer_class_path`, read where torch is loaded anyway) loads with that class
directly and never imports torch: the server's front end, told by its engine-core process.

The EOS ids follow what transformers' ``generate`` would use: ``generation_config.json``
when the directory has one (an explicit ``null`` there means "never stop on EOS"), else the
model config, else the tokenizer's own EOS token.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str | Path, tokenizer_class: str | None = None) -> Any:
    """``model_dir``'s tokenizer; ``tokenizer_class``: the :func:`tokenizer_class_path` of
    the class ``AutoTokenizer`` chose for it, loaded with directly (no torch import)."""
    if tokenizer_class is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    module, _, qualname = tokenizer_class.partition(":")
    cls: Any = importlib.import_module(module)
    for name in qualname.split("."):
        cls = getattr(cls, name)
    # what AutoTokenizer itself calls once it has chosen (``_from_auto`` only tags telemetry)
    return cls.from_pretrained(str(model_dir), local_files_only=True, _from_auto=True)


def tokenizer_class_path(tokenizer: Any) -> str:
    """``"module:qualname"`` of ``tokenizer``'s class, for :func:`load_tokenizer`."""
    cls = type(tokenizer)
    return f"{cls.__module__}:{cls.__qualname__}"


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def encode_prompt(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """A prompt as token ids: text tokenized with the special tokens (BOS) as transformers
    does; ids passed through. An empty text is refused (``RequestRejectedError``)."""
    from inflight.runtime.outputs import RequestRejectedError

    if isinstance(prompt, str):
        if not prompt:
            raise RequestRejectedError("prompt must not be empty", "invalid_request", "prompt")
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    return list(prompt)


def eos_token_ids(hf_config: Any, tokenizer: Any, model_dir: Path) -> tuple[int, ...]:
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        if "eos_token_id" in gen:
            return _as_ids(gen["eos_token_id"])
    from_config = _as_ids(getattr(hf_config, "eos_token_id", None))
    if from_config:
        return from_config
    return _as_ids(getattr(tokenizer, "eos_token_id", None))
