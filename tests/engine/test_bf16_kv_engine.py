"""A float32 engine's bfloat16 KV cache (``kv_cache_dtype bfloat16``, CPU), on seeded random-weight
models: the same memory holds 2x the blocks; the engine runs end to end, agrees with the float32
cache on nearly every greedy token, and the native kernels give the reference's tokens; prefix
caching, preemption, the host tier, speculation, decode graphs and tensor parallelism give the
tokens the bfloat16 engine gives without them; a float16 engine, and a float32 one on CUDA, are
refused at start with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker import kv_sizing
from tests.engine.kv_dtype_invariance import features_keep_their_tokens, tensor_parallel_keeps_tokens
from tests.runtime.hf_reference import prompts_of_lengths, run_staggered

LENGTHS = [3, 17, 9, 33, 12, 25, 6, 40]
CONFIG = dict(device="cpu", dtype="float32", block_size=8, max_num_sequences=8, max_num_tokens=256,
              async_scheduling=False)


def _engine(model_dir: Path, **knobs: object) -> LLMEngine:
    return LLMEngine.from_model_dir(model_dir, EngineConfig(**{**CONFIG, **knobs}))


def _run(engine: LLMEngine, prompts: list[list[int]], per_step: int = 3) -> dict[str, list[int]]:
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True) for _ in prompts]
    out = run_staggered(engine, prompts, params, per_step)
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_used_kv_blocks == 0, "KV blocks leaked"
    return out


def test_the_same_memory_holds_twice_the_blocks(llama_dir, monkeypatch) -> None:
    budget = 1 << 20  # the CPU's KV memory cap, small enough that it decides the block count
    monkeypatch.setattr(kv_sizing, "CPU_KV_CACHE_CAP_BYTES", budget)
    knobs = dict(max_num_sequences=256, max_model_len=512)
    said: list[str] = []
    wide = _engine(llama_dir, **knobs)
    narrow = LLMEngine.from_model_dir(llama_dir, EngineConfig(**{**CONFIG, **knobs, "kv_cache_dtype": "bfloat16"}),
                                      progress=said.append)  # fmt: skip
    try:
        f, b = wide.runner, narrow.runner
        assert b.kv_caches[0][0].dtype == b.kv_caches[0][1].dtype == torch.bfloat16
        assert f.bytes_per_block == 2 * b.bytes_per_block
        assert b.num_kv_blocks == budget // b.bytes_per_block >= 2 * f.num_kv_blocks
        assert any(line.startswith("KV cache:") and "bfloat16" in line for line in said)
    finally:
        wide.close()
        narrow.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_bfloat16_agrees_with_the_float32_cache(model_factory, arch) -> None:
    model_dir = model_factory(arch)
    wide, narrow = _engine(model_dir), _engine(model_dir, kv_cache_dtype="bfloat16")
    try:
        prompts = prompts_of_lengths(wide.tokenizer, LENGTHS)
        want, got = _run(wide, prompts), _run(narrow, prompts)
    finally:
        wide.close()
        narrow.close()
    same = sum(a == b for i in want for a, b in zip(want[i], got[i], strict=True))
    assert sum(len(t) for t in got.values()) == 10 * len(prompts)
    assert same >= 0.9 * 10 * len(prompts), (same, want, got)


def test_the_native_kernels_give_the_references_tokens(llama_dir) -> None:
    """Native store, one-call decode block and prefill over the bfloat16 cache against the torch
    reference's ops on it (the cache holds the same bits; sums differ only in their order)."""
    ref, nat = (_engine(llama_dir, kv_cache_dtype="bfloat16", kernel_backend=b) for b in ("torch", "cpu"))
    try:
        assert nat.runner.ops.name.startswith("cpu-native") and not ref.runner.ops.name.startswith("cpu-native")
        prompts = prompts_of_lengths(ref.tokenizer, LENGTHS)
        want, got = _run(ref, prompts), _run(nat, prompts)
    finally:
        ref.close()
        nat.close()
    assert got == want


def test_a_float16_engine_and_a_float32_one_on_cuda_are_refused(llama_dir) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype bfloat16 takes a float32 or bfloat16 engine"):
        _engine(llama_dir, dtype="float16", kv_cache_dtype="bfloat16")
    from inflight.kernels import fp8_kv

    with pytest.raises(ValueError, match="on the CPU only"):
        fp8_kv.cache_dtype("bfloat16", torch.float32, "cuda")


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding-window layers
def test_prefix_caching_preemption_speculation_and_graphs_keep_their_tokens(model_factory, arch) -> None:
    """Each feature runs the native bfloat16 kernels on other paths (cached prefixes read back,
    recomputation, the host tier's copies, several rows of a sequence in one decode block, the
    decode graphs' replays): each gives the tokens the bfloat16 engine gives without it."""
    from inflight.runtime.worker.graph_backend import RecordingGraphBackend

    model_dir = model_factory(arch)
    prompts, want = features_keep_their_tokens(model_dir, "bfloat16", LENGTHS, _engine, _run)
    backend = RecordingGraphBackend()
    graphed = LLMEngine.from_model_dir(model_dir, EngineConfig(**{**CONFIG, "kv_cache_dtype": "bfloat16",
                                                                  "enable_prefix_caching": False}),
                                       graph_backend=backend)  # fmt: skip
    try:
        assert _run(graphed, prompts, per_step=6) == want and backend.num_replays > 0
    finally:
        graphed.close()


def test_tensor_parallel_gives_the_single_rank_tokens(llama_dir) -> None:
    tensor_parallel_keeps_tokens(llama_dir, "bfloat16", torch.bfloat16, LENGTHS, CONFIG, _engine, _run)
