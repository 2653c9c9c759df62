"""What a narrow KV cache (fp8, or a float32 engine's bfloat16) must keep of every feature that
reads or moves the cache: prefix-cache hits, preemption with and without the host tier, n-gram
and draft-model speculation each give the tokens the same cache gives without them, and so does
tensor parallelism over two ranks. Shared by tests/engine/test_fp8_kv_engine.py and
test_bf16_kv_engine.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.llm import LLM
from tests.runtime.hf_reference import prompts_of_lengths


def features_keep_their_tokens(
    model_dir: Path, kv_cache_dtype: str, lengths: list[int], make: Callable[..., LLMEngine],
    run: Callable[[LLMEngine, list[list[int]], int], Any],
) -> tuple[list[list[int]], Any]:  # fmt: skip
    """Assert the invariance for ``make(model_dir, **knobs)`` engines and ``run(engine, prompts,
    per_step)``; returns the prompts (some sharing a 24-token prefix) and the plain tokens."""
    plain = make(model_dir, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    prompts = prompts_of_lengths(plain.tokenizer, lengths)
    shared = prompts[3][:24]
    prompts += [shared + p[1:6] for p in prompts[:4]]  # prefix-cache hits on a shared 24-token prefix
    want = run(plain, prompts, 3)
    plain.close()
    for knobs in (dict(enable_prefix_caching=True),
                  dict(num_kv_blocks=14, max_num_tokens=64),  # too few blocks for all: preemptions
                  dict(num_kv_blocks=14, max_num_tokens=64, kv_offloading_size=0.01),  # + the host tier
                  dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'),
                  dict(speculative_config=json.dumps({"method": "draft_model", "model": str(model_dir),
                                                      "num_speculative_tokens": 2}))):  # fmt: skip
        eng = make(model_dir, kv_cache_dtype=kv_cache_dtype, **knobs)
        try:
            assert run(eng, prompts, 6) == want, knobs
            if "num_kv_blocks" in knobs:
                assert eng.stats().num_preemptions > 0
            if knobs.get("enable_prefix_caching"):
                assert eng.kv.prefix_cache_hits > 0
        finally:
            eng.close()
    return prompts, want


def tensor_parallel_keeps_tokens(
    model_dir: Path, kv_cache_dtype: str, cache_dtype: torch.dtype, lengths: list[int], config: dict[str, Any],
    make: Callable[..., LLMEngine], run: Callable[[LLMEngine, list[list[int]]], Any],
) -> None:  # fmt: skip
    """Assert that two tensor-parallel ranks with ``kv_cache_dtype`` (rank 0's cache in
    ``cache_dtype``) give the single rank's tokens."""
    one = make(model_dir, kv_cache_dtype=kv_cache_dtype)
    prompts = prompts_of_lengths(one.tokenizer, lengths)
    want = run(one, prompts)
    one.close()
    llm = LLM(model_dir, tensor_parallel_size=2, kv_cache_dtype=kv_cache_dtype, **config)
    try:
        assert llm.engine.runner.kv_caches[0][0].dtype == cache_dtype
        assert run(llm.engine, prompts) == want
    finally:
        llm.close()
