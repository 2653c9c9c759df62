"""SmolLM2's tokenizer decodes with ``tokenizers``' ``DecodeStream``, and that gives exactly the
Python window's text, delta by delta, and ``tokenizer.decode(all ids)``, over many random token
sequences (tests/runtime/test_detokenizer_stream.py holds the comparison)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from tests.runtime.test_detokenizer_stream import assert_decoders_agree


def test_smollm2s_tokenizer_decodes_the_same_with_the_stream(smollm2_dir: Path) -> None:
    assert_decoders_agree(AutoTokenizer.from_pretrained(smollm2_dir), 600, seed=1)
