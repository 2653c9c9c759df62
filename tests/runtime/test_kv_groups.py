"""Per-group KV tables in the engine: Gemma 3 and gpt-oss token-exact against transformers.

Both tiny models have one sliding-window layer and one full-attention layer, so they get two KV
groups of one layer each (worker/kv_layout.py), one pool of one-layer blocks, and each layer reads
its own group's table. Greedy outputs equal transformers' ``generate`` with steps that mix prompts
and decodes, with chunked context, under preemption and with prefix-cache hits; the sliding
group's blocks really go back to the pool (fewer blocks held than the full group's at the end of a
long generation); nothing leaks; ``INFLIGHT_KV_GROUPS=0`` gives one table and the same tokens;
async steps, n-gram drafts, decode graphs (the CPU stand-in), the torch references, embeddings on
the generate model and the stats all take the groups; and the Triton kernels (in the interpreter)
take the per-layer tables too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.kv_groups import GroupedKVCacheManager
from inflight.runtime.core.kv_manager import KVCacheManager, cdiv
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.sampling_params import SamplingParams

from .family_checks import check_tp2_matches_tp1, check_triton_matches_hf, cpu_config, prompts_for
from .hf_reference import assert_engine_matches_hf, hf_greedy, run_staggered

LENGTHS = [40, 3, 90, 9, 57, 16, 73, 1]
MAX_TOKENS = [24, 30, 12, 20, 16, 26, 10, 28]
FAMILIES = {"gemma3": (16, {}), "gpt_oss": (8, {"sliding_window": 8, "swiglu_limit": 1.0})}  # window, overrides


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    window, overrides = FAMILIES[request.param]
    model_dir = make_demo_model(tmp_path_factory.mktemp(request.param), request.param, seed=5,
                                config_overrides=overrides or None)  # fmt: skip
    return model_dir, window


def _grouped(engine: LLMEngine) -> GroupedKVCacheManager:
    assert isinstance(engine.kv, GroupedKVCacheManager) and engine.kv.windows[0] is None
    return engine.kv


@pytest.mark.parametrize("knobs", [
    dict(num_kv_blocks=128, max_num_tokens=512),  # steps mixing prompts and decodes
    dict(num_kv_blocks=128, max_num_tokens=13, enable_chunked_context=True),  # chunked context
    dict(num_kv_blocks=128, max_num_tokens=32, kernel_backend="torch"),  # the torch references
], ids=["mixed", "chunked", "torch"])  # fmt: skip
def test_matches_transformers(family, knobs):
    model_dir, _ = family
    engine = assert_engine_matches_hf(model_dir, cpu_config(**knobs), prompts_for(model_dir, LENGTHS), MAX_TOKENS)
    kv = _grouped(engine)
    assert engine.pool.num_blocks == 128 * kv.num_groups  # num_kv_blocks is per group


@pytest.mark.parametrize("knobs", [
    dict(async_scheduling=True),  # steps pipelined: the next step's tables made while one is in flight
    dict(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
                            '"prompt_lookup_min": 1}'),  # drafts: every group's slots for them
], ids=["async", "ngram"])  # fmt: skip
def test_async_and_ngram_speculation(family, knobs):
    model_dir, _ = family
    config = cpu_config(num_kv_blocks=128, max_num_tokens=64, enable_chunked_context=True, **knobs)
    prompts = [p * 3 for p in prompts_for(model_dir, [9, 14, 5, 21])]  # repetitive: n-grams find drafts
    engine = assert_engine_matches_hf(model_dir, config, prompts, [30, 24, 28, 20])
    _grouped(engine)
    if "speculative_config" in knobs:
        assert engine.stats().spec_num_drafts > 0


def test_preemption(family):
    model_dir, _ = family
    config = cpu_config(num_kv_blocks=12, block_size=16, max_num_tokens=256, enable_prefix_caching=False)
    engine = assert_engine_matches_hf(model_dir, config, prompts_for(model_dir, LENGTHS), MAX_TOKENS)
    _grouped(engine)
    assert engine.stats().num_preemptions > 0


def test_prefix_hits(family):
    model_dir, _ = family
    config = cpu_config(num_kv_blocks=128, max_num_tokens=256, enable_prefix_caching=True)
    base = prompts_for(model_dir, [50])[0]
    prompts = [base + t[1:] for t in prompts_for(model_dir, [3, 9, 20, 1, 14, 30])] + [base]
    engine = assert_engine_matches_hf(model_dir, config, prompts, [10, 14, 8, 12, 16, 9, 11])
    _grouped(engine)
    assert engine.stats().prefix_cache_hits > 0


def _generate_long(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
    """One greedy request to its end; its tokens, and the most pool blocks held at any step."""
    engine.add_request("long", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    peak = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        peak = max(peak, engine.pool.num_used_blocks)
        req = engine.scheduler.requests.get("long")
        if req is not None and isinstance(engine.kv, GroupedKVCacheManager):
            full, sliding = engine.kv.blocks_held_by_group([req])
            assert full == len(req.block_ids)
            assert sliding <= cdiv(engine.kv.windows[1] - 1, 16) + 2
    return tokens, peak


def test_sliding_group_releases_and_off_switch_keeps_one_table(family, monkeypatch):
    model_dir, _ = family
    prompt = prompts_for(model_dir, [20])[0]
    config = cpu_config(num_kv_blocks=64, block_size=16, max_num_tokens=64, enable_prefix_caching=False)
    grouped = LLMEngine.from_model_dir(model_dir, config)
    _grouped(grouped)
    tokens, peak_grouped = _generate_long(grouped, prompt, 140)
    assert tokens == hf_greedy(model_dir, prompt, 140)
    assert grouped.pool.num_used_blocks == 0, "KV blocks leaked"
    monkeypatch.setenv("INFLIGHT_KV_GROUPS", "0")
    single = LLMEngine.from_model_dir(model_dir, config)
    assert type(single.kv) is KVCacheManager and single.pool.num_blocks == 64
    tokens_single, peak_single = _generate_long(single, prompt, 140)
    assert tokens_single == tokens
    # one table: 10 blocks of both layers; groups: 10 full-group blocks + the window's few, of one layer
    assert peak_single == cdiv(160, 16)
    assert peak_grouped < 2 * peak_single


def test_decode_graphs_read_every_groups_table(family):
    """Pure-decode steps replayed on the CPU stand-in for CUDA graphs (under its host-sync guard): each
    group's slots and table have static buffers too; the tokens are transformers'."""
    from inflight.runtime.worker.graph_backend import RecordingGraphBackend

    model_dir, _ = family
    if model_dir.name.startswith("gpt_oss"):
        pytest.skip("the CPU's expert layers (reference fused_moe) read tensors on the host: no graphs there")
    config = cpu_config(kernel_backend="cpu", num_kv_blocks=96, max_num_sequences=8, max_num_tokens=64)
    prompts = prompts_for(model_dir, [3, 17, 9, 30, 1, 12])
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0.0) for i in range(len(prompts))]
    eager = run_staggered(LLMEngine.from_model_dir(model_dir, config), prompts, params, per_step=6)  # warms the kernels
    backend = RecordingGraphBackend()
    engine = LLMEngine.from_model_dir(model_dir, config, graph_backend=backend)
    _grouped(engine)
    assert engine.runner.graphs is not None and engine.runner.graphs.group_tables is not None
    got = run_staggered(engine, prompts, params, per_step=6)
    assert backend.num_replays > 10  # most steps were pure decode, on the graphs
    assert got == eager
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(model_dir, prompt, 20 + 3 * i), f"prompt {i} diverged"
    assert engine.pool.num_used_blocks == 0


def test_cpu_decode_lanes_cut_every_groups_rows(family, monkeypatch):
    from inflight.runtime.worker.cpu import device_setup
    from inflight.runtime.worker.cpu import lanes as cpu_lanes

    monkeypatch.setenv("INFLIGHT_CPU_LANES", "2")
    monkeypatch.setattr(cpu_lanes, "MIN_PARAM_TOKENS", 0)
    monkeypatch.setattr(cpu_lanes, "MIN_ROWS_PER_LANE", 1)
    monkeypatch.setattr(device_setup, "ROW_FLOPS_FOR_EVERY_CORE", 0)  # the test models' rows are tiny
    model_dir, _ = family
    engine = LLMEngine.from_model_dir(model_dir, cpu_config(num_kv_blocks=96, max_num_tokens=256))
    _grouped(engine)
    lanes = engine.runner._lanes
    assert lanes is not None
    lanes.min_rows = 2
    calls = []
    original = lanes.forward
    monkeypatch.setattr(lanes, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    prompts = prompts_for(model_dir, [3, 17, 9, 30, 1, 12])
    params = [SamplingParams(max_tokens=20 + 3 * i, temperature=0.0) for i in range(len(prompts))]
    got = run_staggered(engine, prompts, params, per_step=6)
    assert len(calls) > 5  # most steps went through the lanes
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(model_dir, prompt, 20 + 3 * i), f"prompt {i} diverged"
    engine.close()


def test_stats_and_metrics_count_blocks_per_group(family):
    from inflight.runtime.server.metrics import ServerMetrics

    model_dir, window = family
    engine = LLMEngine.from_model_dir(model_dir, cpu_config(num_kv_blocks=64, block_size=16))
    engine.add_request("a", prompts_for(model_dir, [20])[0], SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(50):
        engine.step()
    stats = engine.stats()
    req = engine.scheduler.requests["a"]
    full = cdiv(req.num_computed_tokens, 16)
    assert stats.kv_group_names == ("full-0", f"sliding{window}-1")
    assert stats.kv_blocks_held_by_group[0] == full and stats.kv_blocks_held_by_group[1] < full
    assert stats.num_used_kv_blocks == sum(stats.kv_blocks_held_by_group) and stats.num_kv_blocks == 128
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert f'inflight:kv_blocks_held{{group="full-0",model_name="m"}} {full}.0' in text


def test_pooled_prompt_uses_every_groups_table(family):
    """An embedding on the generate model (core/mixed_pooling.py) packs every group's table: its vector is
    transformers', and the blocks it leaves in the prefix cache serve a later prompt token-exact."""
    import numpy as np

    from inflight.runtime.server.pooling_api.common import POOLING_PARAMS

    from .pooling_models import reference_embedding

    model_dir, _ = family
    engine = LLMEngine.from_model_dir(model_dir, cpu_config(num_kv_blocks=64, block_size=16, max_num_tokens=16))
    _grouped(engine)
    ids = prompts_for(model_dir, [41])[0]
    engine.add_request("p", ids, POOLING_PARAMS)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    vector = np.frombuffer(outs[-1].pooled, dtype="<f4")
    np.testing.assert_allclose(vector, reference_embedding(model_dir, ids, "LAST", normalize=False),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    prompt = ids + prompts_for(model_dir, [9])[0][1:]
    engine.add_request("g", prompt, SamplingParams(max_tokens=12, temperature=0.0))
    tokens = []
    while engine.has_unfinished_requests():
        tokens.extend(t for out in engine.step() for t in out.new_token_ids)
    assert engine.stats().prefix_cache_hits > 0
    assert tokens == hf_greedy(model_dir, prompt, 12)


def test_tensor_parallel_ranks_take_the_groups(family):
    """TP=2 (gloo on the CPU): every rank holds the grouped cache, the step's wire carries every
    group's slots and tables, and the tokens are TP=1's."""
    model_dir, _ = family
    check_tp2_matches_tp1(model_dir, model_dir.name, inspect=_grouped)


def test_triton_kernels_take_per_layer_tables(family):
    model_dir, _ = family
    if model_dir.name.startswith("gpt_oss"):
        pytest.skip("one family is enough in the interpreter (gemma3)")
    check_triton_matches_hf(model_dir, lengths=(40, 9), max_tokens=(30, 24))
