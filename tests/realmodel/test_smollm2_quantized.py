"""SmolLM2's GGUF served in its own blocks (Q4_1 layers, Q8_0 tied embedding) against transformers.

transformers' own GGUF load dequantizes to float32; our quantized engine keeps the packed
blocks and dequantizes them inside the matmul with gguf's exact float32 arithmetic, so every
weight is bit-identical to transformers' and only the summation order differs (as it does for
the float32 engine): greedy decoding must be token-exact.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.runtime import LLM, SamplingParams
from inflight.runtime.model.quantized import resident_weight_bytes
from inflight.runtime.tokenizer import load_tokenizer
from tests.realmodel.helpers import CHAT_PROMPTS, chat_ids

MAX_TOKENS = 16
ENGINE = dict(max_model_len=1024, num_kv_blocks=256, max_num_sequences=8, device="cpu", dtype="float32")


def test_served_packed_by_default_and_token_exact_with_transformers(smollm2_dir: Path, hf_gguf_greedy) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    prompts = [chat_ids(tokenizer, q) for q in CHAT_PROMPTS[:6]]
    llm = LLM(str(smollm2_dir), **ENGINE)  # quantization=auto: the directory links to its GGUF file
    runner = llm.engine.runner
    assert runner.quantization.method == "gguf" and runner.ops.name.endswith("+packed")
    assert llm.engine.resolved["quantization"] == "gguf"
    dense = LLM(str(smollm2_dir), quantization="none", **ENGINE)
    assert dense.engine.runner.quantization.method == "none"
    assert resident_weight_bytes(runner.model) < resident_weight_bytes(dense.engine.runner.model) / 4
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))]
    theirs = hf_gguf_greedy(prompts, MAX_TOKENS)
    for q, a, b in zip(CHAT_PROMPTS, ours, theirs, strict=False):
        assert a == b, f"{q!r}: ours {tokenizer.decode(a)!r} vs transformers {tokenizer.decode(b)!r}"
    assert "Paris" in tokenizer.decode(ours[0])


def test_quantization_choices_that_cannot_apply_are_refused(smollm2_dir: Path, smollm2_gguf: Path,
                                                            tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(smollm2_gguf), quantization="awq", **ENGINE)
    plain = tmp_path / "plain"  # the converted directory without its link back to the file
    plain.mkdir()
    for f in smollm2_dir.iterdir():
        if f.name != "source.gguf":
            (plain / f.name).symlink_to(f)
    with pytest.raises(ValueError, match="needs a .gguf file"):
        LLM(str(plain), quantization="gguf", **ENGINE)
    with pytest.raises(ValueError, match="compressed-tensors quantization_config"):
        LLM(str(plain), quantization="compressed-tensors", **ENGINE)
    with pytest.raises(ValueError, match="float32 activations"):  # the native kernels take float32
        LLM(str(smollm2_gguf), quantization="gguf", **{**ENGINE, "dtype": "bfloat16"})
    auto = LLM(str(smollm2_gguf), **{**ENGINE, "dtype": "bfloat16"})  # auto: dequantized, and says why
    assert auto.engine.runner.quantization.method == "none"
    assert "float32 activations" in auto.engine.runner.quantization.why
