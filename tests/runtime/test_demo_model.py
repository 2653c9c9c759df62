"""The demo-model maker writes ordinary Hugging Face directories that decode non-trivially."""

from __future__ import annotations

import pytest

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.demo.model import main


def test_tokenizer_has_special_tokens_and_chat_template(llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    assert tok.bos_token == "<s>" and tok.eos_token == "</s>" and tok.pad_token == "<pad>"
    ids = tok.encode("def f(): pass")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "def f(): pass"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n") and "hi" in chat


def test_greedy_decoding_does_not_collapse(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64)
    outs = llm.generate(["def fib(n):", "import os", "class A:"],
                        SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    for out in outs:
        assert len(set(out.token_ids)) >= 8, out.token_ids


def test_cli_rejects_unknown_arch(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--arch", "gpt2"])
    assert "invalid choice" in capsys.readouterr().err


def test_the_demo_bpe_is_trained_once_and_each_call_gets_its_own_tokenizer() -> None:
    """train_tokenizer keeps the trained BPE per process (training is deterministic: a retrain is
    the same tokenizer), but hands every caller a tokenizer object of its own."""
    from inflight.runtime.demo.model import _trained_bpe, train_tokenizer

    first, other = train_tokenizer(512, "llama"), train_tokenizer(512, "qwen3")
    assert first is not other and first.backend_tokenizer is not other.backend_tokenizer
    assert first.chat_template != other.chat_template  # the family's template, per call
    first.add_tokens(["<only-in-first>"])  # a caller changing its tokenizer changes no other
    assert "<only-in-first>" not in train_tokenizer(512, "llama").get_vocab()
    _trained_bpe.cache_clear()
    assert train_tokenizer(512, "llama").backend_tokenizer.to_str() == other.backend_tokenizer.to_str()
