"""The engine on the Triton kernels (interpreter on the CPU) generates what it does on the
torch references: chunked prompts, a shared prefix (prefix-cache hits), ragged decodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow


def _generate(model_dir: Path, backend: str, device: torch.device) -> dict[str, list[int]]:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.sampling_params import SamplingParams

    config = EngineConfig(
        kernel_backend=backend, device=device.type, dtype="float32", block_size=16,
        num_kv_blocks=64, max_num_tokens=24,
    )  # fmt: skip
    engine = LLMEngine.from_model_dir(model_dir, config)
    assert engine.runner.ops.name == backend
    prompts = [[5] * 3, [6] * 17, [9] * 40, [9] * 40]  # ragged, chunked, shared prefix
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert engine.stats().prefix_cache_hits > 0
    return tokens


def test_engine_greedy_tokens_match_torch_backend(
    tiny_model_dir: Path, device: torch.device
) -> None:
    # qwen3: a llama-family decoder that also runs the per-head (qk) RMSNorm kernel.
    assert _generate(tiny_model_dir, "triton", device) == _generate(tiny_model_dir, "torch", device)
