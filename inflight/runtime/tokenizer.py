"""Tokenizer loading and the end-of-sequence ids, read from a local model directory.

The EOS ids follow what transformers' ``generate`` would use: ``generation_config.json``
when the directory has one (an explicit ``null`` there means "never stop on EOS"), else the
model config, else the tokenizer's own EOS token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


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
