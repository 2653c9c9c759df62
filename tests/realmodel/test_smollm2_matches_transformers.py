"""SmolLM2-135M-Instruct from its GGUF file: our conversion and engine against transformers.

The reference is transformers loading the same GGUF file with its own GGUF support. Checks:
the converted weights are bit-identical to transformers' dequantized ones; our tokenizer and
chat template give the same ids and text; greedy decoding is token-exact in float32 for 18
chat prompts decoded together (8 at a time, so later ones board as earlier ones finish).

bfloat16 tolerance policy: the engine in bfloat16 is compared with transformers in
bfloat16. Rounding differs between the two implementations (fused q/k/v, packed batches), so
an output may diverge, but only at a near tie: at the first differing position the engine's
token must be transformers' top-2 choice with a logit gap below ``BF16_MAX_LOGIT_GAP``, and at
least ``BF16_MIN_EXACT`` of the 18 outputs (16 tokens each) must match token for token.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.model.loader import checkpoint_tensors
from inflight.runtime.tokenizer import load_tokenizer
from tests.realmodel.helpers import CHAT_PROMPTS, chat_ids

MAX_TOKENS = 24
BF16_MAX_TOKENS = 16  # bfloat16 matmuls are slow on the CPU; keep the suite's time modest
BF16_MAX_LOGIT_GAP = 0.5
BF16_MIN_EXACT = 12
# the float path (the directory links to its GGUF file, which quantization=auto would serve packed:
# test_smollm2_quantized.py checks that one)
ENGINE = dict(max_model_len=1024, num_kv_blocks=256, max_num_sequences=8, device="cpu", quantization="none")


def _engine_greedy(model_dir: Path, prompts: list[list[int]], dtype: str, max_tokens: int) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype=dtype, **ENGINE)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    return [o.token_ids for o in outs]


def test_converted_weights_are_bit_identical_to_transformers_gguf_load(smollm2_dir: Path, hf_gguf_model) -> None:
    reference = hf_gguf_model.state_dict()
    ours = dict(checkpoint_tensors(smollm2_dir))  # float tensors from safetensors, quantized ones from the file
    assert len(ours) == len([n for n in reference if n != "lm_head.weight"]) == 272  # 9 per layer x 30, embeddings, final norm
    for name, part in ours.items():
        assert torch.equal(part[:], reference[name]), name
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 100000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_tokenizer_and_chat_template_match_transformers(smollm2_dir: Path, hf_gguf_tokenizer) -> None:
    ours = load_tokenizer(smollm2_dir)
    texts = ["Hello, world!", "12345 apples cost $6.78", "  leading spaces\tand\ttabs\n\nnewlines",
             "naïve café – ünïcödé 日本語 😀", "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2"]
    for text in texts:
        assert ours.encode(text) == hf_gguf_tokenizer.encode(text), text
        assert ours.decode(ours.encode(text)) == text
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "Tell me a joke."}],
    ]
    for messages in conversations:
        text = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text == hf_gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text.endswith("<|im_start|>assistant\n")
    assert (ours.bos_token_id, ours.eos_token_id) == (1, 2)


def test_greedy_float32_is_token_exact_with_transformers(smollm2_dir: Path, hf_gguf_greedy) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    prompts = [chat_ids(tokenizer, q) for q in CHAT_PROMPTS]
    ours = _engine_greedy(smollm2_dir, prompts, "float32", MAX_TOKENS)
    theirs = hf_gguf_greedy(prompts, MAX_TOKENS)
    exact = sum(a == b for a, b in zip(ours, theirs, strict=True))
    print(f"float32 greedy: {exact}/{len(prompts)} token-exact")
    for q, a, b in zip(CHAT_PROMPTS, ours, theirs, strict=True):
        assert a == b, f"{q!r}: ours {tokenizer.decode(a)!r} vs transformers {tokenizer.decode(b)!r}"
    assert "Paris" in tokenizer.decode(ours[0])


@pytest.mark.slow
def test_greedy_bfloat16_diverges_only_at_near_ties(smollm2_dir: Path, hf_gguf_model, hf_gguf_greedy) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    prompts = [chat_ids(tokenizer, q) for q in CHAT_PROMPTS]
    ours = _engine_greedy(smollm2_dir, prompts, "bfloat16", BF16_MAX_TOKENS)
    model = None  # transformers in bfloat16, made at the first divergence that needs its logits
    try:
        exact = 0
        for q, prompt, mine, theirs in zip(CHAT_PROMPTS, prompts, ours,
                                           hf_gguf_greedy(prompts, BF16_MAX_TOKENS, torch.bfloat16), strict=True):
            if mine == theirs:
                exact += 1
                continue
            common = min(len(mine), len(theirs))  # one may have stopped at EOS
            k = next((i for i in range(common) if mine[i] != theirs[i]), common)
            assert k < len(mine), f"{q!r}: ours stopped early, at a prefix of transformers' output"
            if model is None:
                # A copy: casting the session's float32 model to bfloat16 and back would round its
                # weights for every later test that compares with it.
                model = copy.deepcopy(hf_gguf_model).to(torch.bfloat16)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + theirs[:k]])).logits[0, -1].float()
            top2 = torch.topk(logits, 2).indices.tolist()
            gap = float(logits.max() - logits[mine[k]])
            assert mine[k] in top2 and gap < BF16_MAX_LOGIT_GAP, (
                f"{q!r}: diverged at token {k} with logit gap {gap:.3f} (top-2 {top2}, ours {mine[k]})"
            )
        print(f"bfloat16 greedy: {exact}/{len(prompts)} token-exact, the rest diverge at near ties")
        assert exact >= BF16_MIN_EXACT
    finally:
        del model
