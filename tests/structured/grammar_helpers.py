"""What the grammar-manager tests share: a tiny llama demo model, its tokenizer, and a
``StructuredOutputManager`` over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inflight.runtime.structured.manager import StructuredOutputManager


def make_llama(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A tiny random llama demo model (with its byte-level BPE tokenizer) in a new folder."""
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp(name) / "llama", arch="llama", size="tiny")


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def make_manager(tokenizer: Any, **kw: Any) -> StructuredOutputManager:
    """A manager over ``tokenizer``'s own vocabulary and EOS (``kw``: the manager's options)."""
    return StructuredOutputManager(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), **kw)
