"""The host tier in the engine, on a seeded random model: multi-turn chats whose shared prefixes
overflow a small device pool give the same greedy tokens with the tier as without it (steps run
synchronously and pipelined, with preemptions, with a draft model whose KV is copied too), the
hits really come from the host (fewer prompt tokens computed; with the copy-ins replaced by
zeros the tokens change), no block leaks, the copies are counted (the simulated device counts
their bytes), and /metrics shows the tier under vLLM's names."""

from __future__ import annotations

import json
import random

import pytest
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.sched_output import KVCopies
from inflight.runtime.outputs import EngineStats
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.server.metrics import ServerMetrics
from inflight.runtime.worker.kv_copies import HostKV
from tests.devices import on_devices

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _engine(model_dir, offload: float | None, **knobs) -> LLMEngine:
    config = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=12, max_num_sequences=2,
                  max_num_tokens=64, kv_offloading_size=offload)
    return LLMEngine.from_model_dir(model_dir, EngineConfig(**{**config, **knobs}))


def _chats(engine: LLMEngine, num_chats: int = 3, num_turns: int = 3, seed: int = 0) -> dict[str, list[int]]:
    """Round-robin multi-turn chats: each turn's prompt is the chat so far (system prefix, earlier
    turns and their replies) plus a new user message; every chat's turn is served before the next."""
    rng = random.Random(seed)
    system = [rng.randrange(5, 500) for _ in range(12)]
    history = [system + [rng.randrange(5, 500) for _ in range(10)] for _ in range(num_chats)]
    out: dict[str, list[int]] = {}
    for turn in range(num_turns):
        for c in range(num_chats):
            prompt = history[c] + [rng.randrange(5, 500) for _ in range(3)]
            req_id = f"{c}-{turn}"
            engine.add_request(req_id, prompt, SamplingParams(max_tokens=4, **GREEDY))
            while engine.has_unfinished_requests():
                for o in engine.step():
                    out.setdefault(o.req_id, []).extend(o.new_token_ids)
            history[c] = prompt + out[req_id]
    return out


def _burst(engine: LLMEngine, seed: int = 1) -> dict[str, list[int]]:
    """Requests sharing prefixes, all at once: a small pool makes the scheduler preempt."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 500) for _ in range(20)] for _ in range(4)]
    for i in range(12):
        engine.add_request(str(i), prefixes[i % 4] + [rng.randrange(5, 500) for _ in range(2 + i)],
                           SamplingParams(max_tokens=6, **GREEDY))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return out


def _check_clean(engine: LLMEngine) -> None:
    engine.pool.check_invariants()
    assert engine.pool.num_used_blocks == 0, "a KV block leaked"
    if engine.kv.host_tier is not None:
        engine.kv.host_tier.check_invariants()


def _reference(model_dir, device: str = "cpu") -> dict:
    engine = _engine(model_dir, None, device=device)
    try:
        out = _chats(engine)
        stats = engine.stats()
        assert stats.num_host_kv_blocks == 0 and stats.external_prefix_cache_hits == 0
        return {"tokens": out, "computed": stats.num_prefill_computed_tokens}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference(llama_dir) -> dict:
    return _reference(llama_dir)


@pytest.mark.parametrize("device", on_devices("cpu", "cuda"))
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_same_tokens_with_the_tier_and_hits_from_the_host(llama_dir, reference, async_scheduling: bool,
                                                          device: str) -> None:
    """On CUDA (``make gpu-check``) the copies go through pinned memory on the compute stream,
    before eager steps and decode-graph replays alike."""
    if device != "cpu":
        reference = _reference(llama_dir, device)
    engine = _engine(llama_dir, 0.001, async_scheduling=async_scheduling, device=device)
    try:
        out = _chats(engine)
        stats = engine.stats()
        _check_clean(engine)
    finally:
        engine.close()
    assert out == reference["tokens"]
    assert stats.external_prefix_cache_hits > 0 and stats.kv_offload_loaded_blocks > 0
    assert stats.num_prefill_computed_tokens == reference["computed"] - stats.external_prefix_cache_hits
    assert stats.kv_offload_stored_blocks > 0 and stats.num_used_host_kv_blocks > 0
    per_block = engine.host_kv.bytes_per_block  # type: ignore[union-attr]
    blocks = stats.kv_offload_stored_blocks + stats.kv_offload_loaded_blocks
    assert stats.kv_offload_bytes == blocks * per_block


def test_copy_ins_replaced_by_zeros_change_the_tokens(llama_dir, reference, monkeypatch) -> None:
    """The check above can fail: the host's KV is what the hits read."""
    real_run = HostKV._run_cpu

    def zero_copy_ins(self: HostKV, copies: KVCopies) -> None:
        real_run(self, KVCopies(copy_out=copies.copy_out))
        blocks = torch.tensor([b for _, b in copies.copy_in], dtype=torch.long)
        for dev, _host in self._pairs:
            dev[blocks] = 0.0

    monkeypatch.setattr(HostKV, "_run_cpu", zero_copy_ins)
    engine = _engine(llama_dir, 0.001)
    try:
        out = _chats(engine)
        assert engine.stats().external_prefix_cache_hits > 0
    finally:
        engine.close()
    assert out != reference["tokens"]


def test_preemption_keeps_the_tokens(llama_dir) -> None:
    results = []
    for offload in (None, 0.001):
        engine = _engine(llama_dir, offload, num_kv_blocks=16, max_num_sequences=4)
        try:
            results.append((_burst(engine), engine.stats()))
            _check_clean(engine)
        finally:
            engine.close()
    (plain, plain_stats), (tiered, stats) = results
    assert plain_stats.num_preemptions > 0 and stats.num_preemptions > 0
    assert stats.external_prefix_cache_hits > 0
    assert tiered == plain


def test_a_tiny_tier_evicts_and_stays_exact(llama_dir, reference) -> None:
    """A tier of a few blocks is full all the time: it evicts least-recently-used, drops what it
    cannot take, and the tokens stay the same."""
    engine = _engine(llama_dir, 0.001, async_scheduling=False)
    per_block = engine.host_kv.bytes_per_block  # type: ignore[union-attr]
    engine.close()
    engine = _engine(llama_dir, 3.5 * per_block / 2**30)
    try:
        assert engine.kv.host_tier is not None and engine.kv.host_tier.num_slots == 3
        out = _chats(engine)
        tier = engine.kv.host_tier
        assert tier.num_evicted_blocks > 0
        _check_clean(engine)
    finally:
        engine.close()
    assert out == reference["tokens"]


def test_a_draft_models_kv_travels_too(llama_dir) -> None:
    spec = json.dumps({"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 2,
                       "disable_by_batch_size": 64})
    results = []
    for offload in (None, 0.002):
        engine = _engine(llama_dir, offload, speculative_config=spec)
        try:
            results.append((_chats(engine), engine.stats()))
            if offload is not None:  # the draft is the target itself: its KV must equal the target's
                cached = sorted(engine.pool._cached.values())
                assert engine.kv.host_tier.num_loaded_blocks > 0 and cached  # type: ignore[union-attr]
                for (k, v), (dk, dv) in zip(engine.runner.kv_caches, engine.drafter.runner.kv_caches, strict=True):
                    torch.testing.assert_close(dk[cached], k[cached])
                    torch.testing.assert_close(dv[cached], v[cached])
            _check_clean(engine)
        finally:
            engine.close()
    (plain, _), (tiered, stats) = results
    assert stats.external_prefix_cache_hits > 0
    assert tiered == plain


def test_the_simulated_device_counts_copies_and_bytes(llama_dir) -> None:
    engine = _engine(llama_dir, 0.001, device="sim", dtype="auto")
    try:
        _chats(engine)
        stats = engine.stats()
        _check_clean(engine)
        spec = engine.runner.spec
        per_block = 2 * spec.num_layers * 4 * spec.num_kv_heads * spec.head_dim * 2
        assert engine.host_kv.bytes_per_block == per_block  # type: ignore[union-attr]
    finally:
        engine.close()
    assert stats.kv_offload_loaded_blocks > 0
    assert stats.kv_offload_bytes == (stats.kv_offload_stored_blocks + stats.kv_offload_loaded_blocks) * per_block


def test_metrics_show_the_tier_under_vllms_names() -> None:
    stats = EngineStats(num_running=0, num_waiting=0, num_kv_blocks=8, num_used_kv_blocks=0, num_preemptions=0,
                        prefix_cache_queries=100, prefix_cache_hits=40, num_prompt_tokens=100,
                        num_generation_tokens=0, num_tokens_last_step=0, num_steps=1, max_num_sequences=2,
                        num_host_kv_blocks=10, num_used_host_kv_blocks=4, external_prefix_cache_queries=60,
                        external_prefix_cache_hits=32, kv_offload_stored_blocks=9, kv_offload_loaded_blocks=8,
                        kv_offload_bytes=17 * 1024, kv_offload_dropped_blocks=1)
    text = ServerMetrics("m", lambda: stats).render().decode()
    for line in ('inflight:external_prefix_cache_queries_total{model_name="m"} 60.0',
                 'inflight:external_prefix_cache_hits_total{model_name="m"} 32.0',
                 'inflight:host_kv_cache_usage_perc{model_name="m"} 0.4',
                 'inflight:num_host_kv_blocks{model_name="m"} 10.0',
                 'inflight:kv_offload_stored_blocks_total{model_name="m"} 9.0',
                 'inflight:kv_offload_loaded_blocks_total{model_name="m"} 8.0',
                 'inflight:kv_offload_bytes_total{model_name="m"} 17408.0',
                 'inflight:kv_offload_dropped_blocks_total{model_name="m"} 1.0'):
        assert line in text, line


def test_an_fp8_kv_cache_moves_as_bytes_and_stays_exact(llama_dir) -> None:
    results = []
    for offload in (None, 0.001):
        engine = _engine(llama_dir, offload, kv_cache_dtype="fp8")
        try:
            results.append((_chats(engine), engine.stats()))
            _check_clean(engine)
        finally:
            engine.close()
    (plain, _), (tiered, stats) = results
    assert stats.external_prefix_cache_hits > 0
    assert tiered == plain
