"""Releasing the KV blocks that fall wholly outside every layer's sliding window.

When every layer attends within ``W`` tokens, a request holds at most ``cdiv(W - 1, block_size)
+ 1`` blocks while it decodes (the blocks that meet its next query's window ``N - W + 1 .. N``),
and ``cdiv(W + q - 2, block_size) + 1`` during a step that runs ``q`` of its tokens; released
blocks stay in its block table as placeholders the kernels never weigh. A model with any
global layer releases nothing. First the pool, the manager and the scheduler without torch,
then the engine token-exact against transformers, with the bound checked at every step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.block_pool import KVBlockPool
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.core.kv_manager import KVCacheManager, cdiv, release_window
from inflight.runtime.core.request import Request, RequestStatus
from inflight.runtime.core.scheduler import Scheduler
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.sampling_params import SamplingParams

from .fake_engine import FakeEngine
from .hf_reference import hf_greedy, prompts_of_lengths

W, BS = 8, 4
DECODE_BOUND = cdiv(W - 1, BS) + 1  # 3 blocks: those meeting positions N - 7 .. N


def _req(req_id: str, n: int, token: int = 5) -> Request:
    return Request(req_id, [token] * n, SamplingParams(max_tokens=1000), arrival_time=0.0)


def _manager(num_blocks: int = 32, caching: bool = True, window: int | None = W) -> KVCacheManager:
    return KVCacheManager(KVBlockPool(num_blocks, caching), BS, window)


def _compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """What the engine does for a chunk of ``n`` tokens: allocate, compute, register, release."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)
    kv.release_out_of_window(req)


# -- which models release, and which blocks -------------------------------------------------
def _spec(window, sliding_layers, num_layers=4):
    return SimpleNamespace(sliding_window=window, sliding_layers=tuple(sliding_layers), num_layers=num_layers)


@pytest.mark.parametrize(("spec", "want"), [
    (_spec(16, range(4)), 16),  # Mistral; Qwen2 with max_window_layers 0
    (_spec(16, range(1, 4)), None),  # Qwen2 with max_window_layers 1: layer 0 is global
    (_spec(16, (0, 1, 2, 4, 5)), None),  # Gemma 3's local/global pattern
    (_spec(None, ()), None),  # no window anywhere (Llama)
])  # fmt: skip
def test_release_window_only_when_every_layer_is_windowed(spec, want):
    assert release_window(spec) == want


def test_gemma3_spec_releases_nothing():
    transformers = pytest.importorskip("transformers")
    from inflight.runtime.model.spec import spec_from_hf_config

    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                                           head_dim=16, sliding_window=16, architectures=["Gemma3ForCausalLM"])
    spec = spec_from_hf_config(config)
    assert spec.sliding_window == 16 and spec.sliding_layers  # windowed layers exist ...
    assert release_window(spec) is None  # ... but a global layer reads every block


def test_out_of_window_blocks_match_a_brute_force_count():
    kv = _manager()
    for n in range(60):
        # Block b is never read again iff its last position precedes the next query's window.
        want = sum(1 for b in range(n // BS + 1) if (b + 1) * BS - 1 < n - W + 1)
        assert kv.num_out_of_window(n) == want, n
    assert _manager(window=None).num_out_of_window(1000) == 0


# -- the manager ------------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_decoding_holds_a_bounded_number_of_blocks_and_keeps_its_table(caching):
    kv = _manager(caching=caching)
    req = _req("a", 10)
    _compute(kv, req, 10)
    for _ in range(50):
        assert kv.allocate_slots(req, 1)
        assert req.num_held_blocks <= DECODE_BOUND  # during the step: the query at N sees N-7..N
        req.append_token(7)
        req.num_computed_tokens += 1
        kv.cache_computed_blocks(req)
        kv.release_out_of_window(req)
        kv.pool.check_invariants()
    n = req.num_computed_tokens
    assert len(req.block_ids) == cdiv(n, BS)  # placeholders keep every position's entry
    assert req.num_released_blocks == (n - W + 1) // BS
    assert kv.pool.num_used_blocks == req.num_held_blocks
    kv.free(req)  # frees only what it holds: no double free
    assert kv.pool.num_used_blocks == 0 and req.block_ids == [] and req.num_released_blocks == 0
    kv.pool.check_invariants()


def test_a_released_block_another_request_shares_stays_theirs():
    kv = _manager()
    a, b = _req("a", 24), _req("b", 16)
    _compute(kv, a, 16)  # a first chunk; the next query at 16 sees 9..16: blocks 0 and 1 are released
    assert a.num_released_blocks == 2
    hits = kv.find_prefix_hit(b)
    assert hits == a.block_ids[:3]  # released but still cached; one token stays to compute
    assert kv.allocate_slots(b, 4, hits)
    assert b.num_released_blocks == 1  # block 0 ends before 12 - 8 + 1: never shared
    assert [kv.pool.ref_cnt[h] for h in hits] == [0, 1, 2]  # block 1 revived from the free queue
    _compute(kv, a, 8)  # a moves on to 24 tokens: releases its blocks 2 and 3 as well
    assert a.num_released_blocks == 4
    assert [kv.pool.ref_cnt[h] for h in hits] == [0, 1, 1]  # b still holds blocks 1 and 2
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_used_blocks == 0
    kv.pool.check_invariants()


def test_released_cached_blocks_stay_findable_and_a_broken_chain_recomputes():
    kv = _manager(num_blocks=8)
    a = _req("a", 24)
    _compute(kv, a, 24)
    assert a.num_released_blocks == 4
    table = list(a.block_ids)
    assert kv.find_prefix_hit(_req("b", 25)) == table  # released but cached: still a hit
    kv.free(a)
    # Released blocks joined the free queue tail-first (3, 2, 1, 0), after the 2 never used:
    # handing out 4 evicts blocks 3 and 2 of a's chain.
    kv.pool.allocate(4)
    c = _req("c", 25)
    hits = kv.find_prefix_hit(c)
    assert hits == table[:2]  # the chain stops at the first evicted block; nothing after is assumed
    assert kv.allocate_slots(c, 1, hits) and c.num_computed_tokens == 8
    kv.pool.check_invariants()


def test_a_long_prefix_hit_shares_only_the_window():
    kv = _manager(num_blocks=10)
    a = _req("a", 33)
    _compute(kv, a, 33)
    kv.free(a)  # 8 full cached blocks in the free queue
    b = _req("b", 33)
    hits = kv.find_prefix_hit(b)
    assert len(hits) == 8
    free_before = kv.pool.num_free_blocks
    assert kv.allocate_slots(b, 1, hits)
    # 32 tokens computed: the next query at 32 sees 25..32, so blocks 0..5 are placeholders.
    assert b.num_released_blocks == 6 and b.num_held_blocks == 3
    assert free_before - kv.pool.num_free_blocks == 3  # 2 shared + 1 fresh, not 8 + 1
    kv.free(b)
    assert kv.pool.num_used_blocks == 0


def test_release_waits_for_the_prefix_cache_to_register_the_block():
    kv = _manager()
    req = _req("a", 20)
    assert kv.allocate_slots(req, 20)
    req.num_computed_tokens = 20  # computed, not yet registered
    assert kv.release_out_of_window(req) == 0  # a released block must never be registered later
    kv.cache_computed_blocks(req)
    assert kv.release_out_of_window(req) == 3


# -- the scheduler ---------------------------------------------------------------------------
def _windowed_fake(**config) -> FakeEngine:
    fake = FakeEngine(block_size=BS, **config)
    fake.kv = KVCacheManager(fake.pool, BS, W)
    fake.scheduler = Scheduler(fake.config, fake.kv)
    return fake


def _step_bound(num_tokens: int) -> int:
    """Blocks a request may hold during a step that runs ``num_tokens`` of its tokens."""
    return cdiv(W + num_tokens - 2, BS) + 1


@pytest.mark.parametrize("config", [
    dict(num_kv_blocks=64, max_num_tokens=64),
    dict(num_kv_blocks=64, max_num_tokens=7, enable_chunked_context=True),
    dict(num_kv_blocks=7, max_num_tokens=64, enable_prefix_caching=False),  # both preempt
    dict(num_kv_blocks=7, max_num_tokens=64, enable_prefix_caching=True),
])  # fmt: skip
def test_scheduler_keeps_every_request_within_the_bound(config):
    fake = _windowed_fake(**config)
    schedule = fake.scheduler.schedule

    def checked_schedule():
        out = schedule()
        for chunk in out.chunks:
            assert fake.requests[chunk.req_id].num_held_blocks <= _step_bound(chunk.num_tokens), chunk
        return out

    fake.scheduler.schedule = checked_schedule
    for i, (n, m) in enumerate([(10, 60), (3, 40), (20, 70), (9, 50), (17, 45)]):
        fake.add(str(i), n, m, token=5 + i % 2)  # two shared prefixes
    finished: list[str] = []
    for _ in range(2000):
        if not fake.scheduler.has_unfinished():
            break
        finished += fake.step().finished
        for req in fake.scheduler.running:  # the engine releases right after computing
            fake.kv.release_out_of_window(req)
            assert req.num_held_blocks <= DECODE_BOUND, req
        fake.pool.check_invariants()
        held = {b for r in fake.scheduler.running for b in r.block_ids[r.num_released_blocks :]}
        assert fake.pool.num_used_blocks == len(held)  # shared prefix blocks count once
    assert sorted(finished) == ["0", "1", "2", "3", "4"]
    assert fake.pool.num_used_blocks == 0
    if config["num_kv_blocks"] == 7:
        assert fake.scheduler.num_preemptions > 0


def test_a_pool_smaller_than_the_sequence_serves_it():
    fake = _windowed_fake(num_kv_blocks=4, max_num_tokens=64)  # 16 tokens of KV
    fake.add("long", 6, 200)
    fake.run()
    assert fake.requests["long"].num_tokens == 206 and fake.scheduler.num_preemptions == 0
    assert fake.pool.num_used_blocks == 0


def test_without_a_window_nothing_is_released():
    fake = FakeEngine(block_size=BS, num_kv_blocks=64)
    req = fake.add("a", 10, 30)
    for _ in range(20):
        fake.step()
    assert req.num_released_blocks == 0 and req.num_held_blocks == cdiv(req.num_computed_tokens, BS)


def test_finish_and_abort_after_release_free_exactly_once():
    fake = _windowed_fake(num_kv_blocks=32)
    a, b = fake.add("a", 10, 1000), fake.add("b", 10, 1000)
    for _ in range(30):
        fake.step()
    assert a.num_released_blocks > 0 and b.num_released_blocks > 0
    fake.scheduler.remove(a)  # abort while running
    fake.scheduler._preempt(b)  # preempted: waits with nothing held, recomputes later
    assert b.status is RequestStatus.WAITING and b.block_ids == [] and b.num_released_blocks == 0
    assert fake.pool.num_used_blocks == 0
    fake.scheduler.remove(b)
    fake.pool.check_invariants()
    assert fake.pool.num_used_blocks == 0


# -- the kernels' side of the contract ------------------------------------------------------
def test_placeholders_are_never_weighed():
    """Placeholders NaN-poisoned: the native decode kernel never loads them (same output as
    with the real blocks); the torch reference gathers and masks them, so a placeholder must
    be a valid block of finite values, which a released block id is."""
    import torch

    from inflight.kernels import cpu_native, reference

    if cpu_native.load_library()[0] is None:
        pytest.skip("no C compiler for the native kernels")
    torch.manual_seed(0)
    num_blocks, num_heads, num_kv_heads, head_dim = 64, 4, 2, 16
    k, v = torch.randn(2, num_blocks, BS, num_kv_heads, head_dim)
    poison = num_blocks - 1
    k[poison] = v[poison] = float("nan")
    lens = [37, 50, 9, 13]
    table = torch.randperm(num_blocks - 1)[: 4 * 13].view(4, 13).to(torch.int32)
    placeheld = table.clone()
    for s, n in enumerate(lens):  # the query at n - 1: what the manager would have released
        placeheld[s, : KVCacheManager(KVBlockPool(1), BS, W).num_out_of_window(n - 1)] = poison
    assert (placeheld == poison).sum() > 0
    args = (torch.randn(4, num_heads, head_dim), k, v)
    ctx, scale = torch.tensor(lens, dtype=torch.int32), head_dim**-0.5
    want = reference.paged_decode_attention(*args, table, ctx, scale, W)
    torch.testing.assert_close(cpu_native.paged_decode_attention(*args, placeheld, ctx, scale, W), want)
    assert reference.paged_decode_attention(*args, placeheld, ctx, scale, W).isnan().any()


# -- the engine, token-exact against transformers -------------------------------------------

LENGTHS = [30, 3, 25, 9, 17, 1]
MAX_TOKENS = [20, 30, 12, 26, 18, 32]  # every one well past the window


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    mistral = make_demo_model(tmp_path_factory.mktemp("mistral-rel"), "mistral", seed=7,
                              config_overrides={"sliding_window": W})
    qwen2 = make_demo_model(tmp_path_factory.mktemp("qwen2-rel"), "qwen2", seed=7, config_overrides={
        "use_sliding_window": True, "sliding_window": W, "max_window_layers": 1,
        "layer_types": ["full_attention", "sliding_attention"]})  # fmt: skip
    return {"mistral": mistral, "qwen2": qwen2}


def _run_checked(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int], bound: int | None, drafts: int = 0
) -> dict[str, list[int]]:
    """Staggered run (2 prompts per step); after every step each running request holds at most
    ``bound`` blocks, and during one that runs ``q`` of its tokens at most
    ``_step_bound(max(q, drafts + 1))`` (rejected drafts keep their block until the next step)."""
    peaks: list[tuple[int, int]] = []  # (blocks held, tokens run) per chunk, as the runner sees it
    placeholders = 0  # most released entries a table handed to the kernels had
    prepare = engine.runner.prepare

    def watching_prepare(chunks):
        nonlocal placeholders
        reqs = [engine.scheduler.requests[c.req_id] for c in chunks]
        peaks.extend((r.num_held_blocks, c.num_tokens) for r, c in zip(reqs, chunks, strict=True))
        placeholders = max([placeholders] + [r.num_released_blocks for r in reqs])
        return prepare(chunks)

    engine.runner.prepare = watching_prepare
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    added = finished = 0
    for _ in range(10_000):
        for _ in range(2):
            if added < len(prompts):
                engine.add_request(str(added), prompts[added], SamplingParams(max_tokens=max_tokens[added],
                                                                              temperature=0.0))
                added += 1
        for out in engine.step():
            got[out.req_id].extend(out.new_token_ids)
            finished += out.finished
        engine.pool.check_invariants()
        if bound is not None:
            for req in engine.scheduler.running:
                assert req.num_held_blocks <= bound, req
        if finished == len(prompts):
            break
    if bound is not None:
        assert placeholders > 0, "nothing was released"
        for held, q in peaks:
            assert held <= _step_bound(max(q, drafts + 1)), (held, q)
    assert engine.stats().num_used_kv_blocks == 0, "KV blocks leaked"
    return got


def _assert_exact(model_dir, got, prompts, max_tokens):
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(model_dir, prompt, max_tokens[i]), f"prompt {i} diverged"


@pytest.mark.parametrize("case", ["mixed", "chunked", "preempt", "prefix", "speculative", "torch-kernels"])
def test_engine_releases_and_stays_token_exact(models, case):
    model_dir = models["mistral"]
    config = dict(device="cpu", dtype="float32", block_size=BS, num_kv_blocks=128, max_num_tokens=256)
    bound, drafts = DECODE_BOUND, 0
    if case == "chunked":
        config.update(max_num_tokens=7, enable_chunked_context=True)
    elif case == "torch-kernels":  # the references gather placeholder blocks and mask them out
        config.update(max_num_tokens=7, enable_chunked_context=True, kernel_backend="torch")
    elif case == "preempt":
        config.update(num_kv_blocks=14, enable_prefix_caching=False)
    elif case == "speculative":
        drafts = 3  # rejected drafts' slots stay allocated: up to drafts - 1 positions past N
        config.update(speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}')
        bound = _step_bound(drafts)
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(**config))
    prompts = prompts_of_lengths(engine.tokenizer, LENGTHS)
    if case == "prefix":  # later prompts hit blocks the first one already released
        base = prompts_of_lengths(engine.tokenizer, [24])[0]
        prompts = [base] + [base + p[1:] for p in prompts[1:4]]
    max_tokens = MAX_TOKENS[: len(prompts)]
    got = _run_checked(engine, prompts, max_tokens, bound, drafts)
    _assert_exact(model_dir, got, prompts, max_tokens)
    stats = engine.stats()
    if case == "preempt":
        assert stats.num_preemptions > 0
    if case == "prefix":
        assert stats.prefix_cache_hits > 0
    if case == "speculative":
        assert stats.spec_num_drafts > 0


def test_engine_with_a_global_layer_releases_nothing(models, monkeypatch):
    """With one table for every layer (INFLIGHT_KV_GROUPS=0; by default such a model gets per-group
    tables: tests/runtime/test_kv_groups.py) a global layer keeps every block."""
    monkeypatch.setenv("INFLIGHT_KV_GROUPS", "0")
    model_dir = models["qwen2"]
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(device="cpu", dtype="float32", block_size=BS,
                                                              num_kv_blocks=128, max_num_tokens=256))
    assert engine.kv.sliding_window is None
    prompts = prompts_of_lengths(engine.tokenizer, LENGTHS[:2])
    engine.add_request("0", prompts[0], SamplingParams(max_tokens=MAX_TOKENS[0], temperature=0.0))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        for req in engine.scheduler.running:
            assert req.num_released_blocks == 0
            most = max(most, req.num_held_blocks)
    assert most > DECODE_BOUND  # it keeps every block it filled
    got = _run_checked(engine, prompts, MAX_TOKENS[:2], None)
    _assert_exact(model_dir, got, prompts, MAX_TOKENS[:2])
