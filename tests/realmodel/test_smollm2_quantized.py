"""SmolLM2's GGUF served in its own blocks (Q4_1 layers, Q8_0 tied embedding) against transformers.

transformers' own GGUF load dequantizes to float32; our quantized engine keeps the packed
blocks and dequantizes them inside the matmul with gguf's exact float32 arithmetic, so every
weight is bit-identical to transformers' and only the summation order differs (as it does for
the float32 engine): greedy decoding must be token-exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.model.quantized import quantize_runner, quantized_llm, resident_weight_bytes
from inflight.runtime.tokenizer import load_tokenizer
from tests.realmodel.helpers import CHAT_PROMPTS, chat_ids

MAX_TOKENS = 16
ENGINE = dict(max_model_len=1024, num_kv_blocks=256, max_num_sequences=8, device="cpu", dtype="float32")


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_quantized_greedy_is_token_exact_with_transformers(smollm2_dir: Path, smollm2_gguf: Path,
                                                           hf_gguf_model) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    prompts = [chat_ids(tokenizer, q) for q in CHAT_PROMPTS[:6]]
    llm = LLM(str(smollm2_dir), **ENGINE)
    float_bytes = resident_weight_bytes(llm.engine.runner.model)
    summary = quantize_runner(llm.engine.runner, smollm2_gguf)
    assert summary.num_quantized == 4 * 30 + 1 and summary.kept_float == ()  # 4 linears a layer, the head
    assert llm.engine.runner.ops.name.endswith("+packed")
    assert resident_weight_bytes(llm.engine.runner.model) < float_bytes / 4
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))]
    theirs = [_hf_greedy(hf_gguf_model, p) for p in prompts]
    for q, a, b in zip(CHAT_PROMPTS, ours, theirs, strict=False):
        assert a == b, f"{q!r}: ours {tokenizer.decode(a)!r} vs transformers {tokenizer.decode(b)!r}"
    assert "Paris" in tokenizer.decode(ours[0])


def test_quantized_llm_entry_point(smollm2_dir: Path, smollm2_gguf: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantized_llm(smollm2_gguf, quantization="awq", **ENGINE)
    with pytest.raises(ValueError, match="needs a .gguf file"):
        quantized_llm(smollm2_dir, **ENGINE)
    llm = quantized_llm(smollm2_gguf, **ENGINE)
    assert llm.engine.runner.ops.name.endswith("+packed")
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].token_ids) == 4
