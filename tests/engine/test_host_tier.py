"""The host tier's bookkeeping (no model): what it saves, finds and evicts, the order and pins of
a step's copies, its invariants, how the KV manager continues a prefix lookup into it and hands
out fresh blocks for its hits without leaking any, how hits are counted, and the refusals
(prefix caching off, tensor parallelism, a pooling engine, an all-windowed model, sizes that
hold no block)."""

from __future__ import annotations

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.block_pool import KVBlockPool, hash_full_blocks
from inflight.runtime.core.host_tier import HostTier, build_host_tier
from inflight.runtime.core.kv_manager import KVCacheManager, PrefixHit
from inflight.runtime.core.request import Request
from inflight.runtime.core.sched_output import KVCopies
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.kv_copies import num_host_slots

BS = 4


def _key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_save_find_load_and_the_copies_of_a_step() -> None:
    tier = HostTier(3)
    tier.save(7, _key(1), (1, 2, 3, 4))
    tier.save(8, _key(2), (5, 6, 7, 8))
    assert tier.find([_key(1), _key(2), _key(3)], [1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], BS, 0) == [0, 1]
    assert tier.find([_key(1), _key(2)], [1, 2, 3, 4, 5, 6, 7, 0], BS, 0) == [0], "the token check stops a hit"
    assert tier.find([_key(1), _key(2)], [1, 2, 3, 4, 5, 6, 7, 8], BS, 1) == [1], "found from `start` on"
    tier.load([0], [11])
    assert tier.take_copies() == KVCopies(copy_out=((7, 0), (8, 1)), copy_in=((0, 11),))
    assert tier.take_copies() is None
    tier.save(11, _key(1), (1, 2, 3, 4))  # a block brought back and evicted again: the slot still holds it
    assert tier.take_copies() is None and tier.num_saved_blocks == 2 and tier.num_loaded_blocks == 1
    tier.check_invariants()


def test_a_full_tier_evicts_its_least_recently_used_block() -> None:
    tier = HostTier(2)
    tier.save(1, _key(1), (1,) * BS)
    tier.save(2, _key(2), (2,) * BS)
    tier.load(tier.find([_key(1)], [1] * BS, BS, 0), [5])  # key 1 used: key 2 is now the oldest
    tier.take_copies()
    tier.save(3, _key(3), (3,) * BS)
    assert _key(2) not in tier and _key(1) in tier and _key(3) in tier
    assert tier.num_evicted_blocks == 1 and tier.num_used_slots == 2
    assert tier.take_copies() == KVCopies(copy_out=((3, 1),))  # into key 2's old slot
    tier.check_invariants()


def test_a_slot_read_by_this_steps_copy_in_is_never_reused_in_the_step() -> None:
    """A copy-out runs before every copy-in: reusing a slot a copy-in reads would hand the request
    another block's KV. With every slot pinned an evicted block is dropped, not waited for."""
    tier = HostTier(1)
    tier.save(1, _key(1), (1,) * BS)
    tier.take_copies()
    tier.load([0], [9])
    tier.save(2, _key(2), (2,) * BS)
    assert _key(1) in tier and _key(2) not in tier and tier.num_dropped_blocks == 1
    assert tier.take_copies() == KVCopies(copy_in=((0, 9),))
    tier.save(2, _key(2), (2,) * BS)  # the next step: the pin is gone
    assert _key(2) in tier and tier.take_copies() == KVCopies(copy_out=((2, 0),))
    tier.check_invariants()


def test_two_copy_outs_into_one_slot_in_a_step_keep_the_last() -> None:
    tier = HostTier(1)
    tier.save(1, _key(1), (1,) * BS)
    tier.save(2, _key(2), (2,) * BS)  # evicts key 1 before anyone could load it
    assert tier.take_copies() == KVCopies(copy_out=((2, 0),))
    tier.check_invariants()


def test_clear_forgets_every_block_but_the_pinned_ones() -> None:
    tier = HostTier(2)
    tier.save(1, _key(1), (1,) * BS)
    tier.save(2, _key(2), (2,) * BS)
    tier.load([0], [5])
    tier.clear()
    assert _key(1) in tier and _key(2) not in tier
    tier.check_invariants()


def _req(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), 0, None, 0)


def _manager(num_blocks: int, num_slots: int) -> KVCacheManager:
    return KVCacheManager(KVBlockPool(num_blocks), BS, host_tier=HostTier(num_slots))


def _compute(kv: KVCacheManager, req: Request, hits: list[int] | None = None) -> None:
    """Admit ``req`` (with its prefix hit) and mark all its tokens computed (blocks cached)."""
    assert kv.allocate_slots(req, req.num_tokens - req.num_computed_tokens - len(hits or []) * BS, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)


def test_evicted_blocks_are_found_in_the_host_and_come_back_through_fresh_blocks() -> None:
    kv = _manager(num_blocks=4, num_slots=8)
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks + 1
    a = _req("a", prompt)
    _compute(kv, a, kv.find_prefix_hit(a))
    kv.free(a)
    other = _req("x", list(range(100, 116)))  # takes every block: a's cached blocks are evicted
    _compute(kv, other)
    kv.free(other)
    first = kv.take_copies()
    assert first is not None and len(first.copy_out) == 3 and not first.copy_in
    b = _req("b", prompt + [99])
    hits = kv.find_prefix_hit(b)
    assert isinstance(hits, PrefixHit) and hits.num_device == 0 and len(hits) == 3
    assert kv.allocate_slots(b, b.num_tokens - 3 * BS, hits)
    copies = kv.take_copies()
    assert copies is not None and [s for s, _ in copies.copy_in] == [s for _, s in reversed(first.copy_out)]
    assert [blk for _, blk in copies.copy_in] == b.block_ids[:3] and b.num_computed_tokens == 12
    kv.record_lookup(b.num_prompt_tokens, len(hits) * BS)
    assert (kv.prefix_cache_hits, kv.host_tier.hits, kv.host_tier.queries) == (0, 12, 14)
    c = _req("c", prompt + [98])  # the loaded blocks are in the device cache at once
    assert kv.find_prefix_hit(c) == b.block_ids[:3]
    kv.free(b)
    kv.pool.check_invariants()
    kv.host_tier.check_invariants()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks, "a block leaked"


def test_a_lookup_continues_past_the_device_hits_into_the_host() -> None:
    kv = _manager(num_blocks=6, num_slots=8)
    prompt = list(range(1, 18))  # 4 full blocks + 1
    a = _req("a", prompt)
    _compute(kv, a)
    table = list(a.block_ids)
    kv.free(a)  # tail first into the free queue: blocks 3, 2 are evicted before 1, 0
    assert kv.pool.allocate(4) is not None  # the unused block, the partial one, then the 2 tail blocks
    kv.take_copies()
    b = _req("b", prompt + [5])
    hits = kv.find_prefix_hit(b)
    assert isinstance(hits, PrefixHit) and hits.num_device == 2 and len(hits) == 4
    assert hits[:2] == table[:2]


def test_a_host_hit_without_room_changes_nothing() -> None:
    kv = _manager(num_blocks=4, num_slots=8)
    prompt = list(range(1, 14))
    a = _req("a", prompt)
    _compute(kv, a)
    kv.free(a)
    held = kv.pool.allocate(4)
    assert held is not None
    kv.take_copies()
    kv.pool.free(held[:2])
    b = _req("b", prompt)
    hits = kv.find_prefix_hit(b)
    assert len(hits) == 3 and not kv.allocate_slots(b, 1, hits)
    assert kv.take_copies() is None and b.block_ids == [] and kv.pool.num_free_blocks == 2


def test_lookups_without_a_tier_are_unchanged() -> None:
    kv = KVCacheManager(KVBlockPool(8), BS)
    a = _req("a", list(range(1, 14)))
    _compute(kv, a)
    table = list(a.block_ids)
    kv.free(a)
    hits = kv.find_prefix_hit(_req("b", list(range(1, 14))))
    assert type(hits) is list and hits == table[:3]
    assert kv.take_copies() is None
    hashes = hash_full_blocks(list(range(1, 14)), BS, root=kv.pool.root_hash)
    assert kv.pool.find_cached(hashes, list(range(1, 14)), BS) == hits


@pytest.mark.parametrize(("knobs", "said"), [
    ({"enable_prefix_caching": False}, "enable_prefix_caching false"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size > 1"),
    ({"runner": "pooling"}, "runner pooling"),
])
def test_config_refuses_what_the_tier_cannot_serve(knobs: dict, said: str) -> None:
    with pytest.raises(ValueError, match="kv_offloading_size cannot be combined") as exc:
        EngineConfig(kv_offloading_size=1.0, **knobs)
    assert said in str(exc.value)


@pytest.mark.parametrize("size", [0, -1.0, float("nan"), float("inf"), True, "1", 2.0**40])
def test_config_refuses_sizes_that_are_not_a_number_of_gib(size: object) -> None:
    with pytest.raises(ValueError, match="kv_offloading_size must be a number of GiB"):
        EngineConfig(kv_offloading_size=size)


def test_the_manager_refuses_a_tier_it_cannot_keep_exact() -> None:
    with pytest.raises(ValueError, match="prefix caching on and no sliding-window"):
        KVCacheManager(KVBlockPool(4, enable_prefix_caching=False), BS, host_tier=HostTier(2))
    with pytest.raises(ValueError, match="prefix caching on and no sliding-window"):
        KVCacheManager(KVBlockPool(4), BS, sliding_window=8, host_tier=HostTier(2))


def test_build_refuses_windowed_and_pooling_engines_and_tiny_sizes() -> None:
    config = EngineConfig(kv_offloading_size=0.5)
    assert build_host_tier(EngineConfig(), None, (), None, False) is None  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window of 64 tokens"):
        build_host_tier(config, None, (), 64, False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pooling runner"):
        build_host_tier(config, None, (), None, True)  # type: ignore[arg-type]
    assert num_host_slots(1.0, 1 << 20) == 1024
    with pytest.raises(ValueError, match="holds no KV block"):
        num_host_slots(1e-9, 1 << 20)


def test_vllms_flags_reach_the_field(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from inflight.runtime.cli.command import build_parser, engine_config_from_args, main

    args = build_parser().parse_args(["serve", "m", "--kv-offloading-size", "2.5", "--kv-offloading-backend", "native"])
    assert engine_config_from_args(args).kv_offloading_size == 2.5
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path / "no-model"), "--kv-offloading-backend", "lmcache"])
    assert exc.value.code == 2 and "only the native backend" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["_run_cpu", "_run_cuda"])
def test_worker_copies_save_before_they_load(path: str) -> None:
    """One step evicts block 1 into slot 0 and loads slot 0 into block 2, and loads slot 1 (saved a
    step before) into blocks 3, 4 ... in runs: block 2 ends with block 1's old KV. The CUDA path's
    slicing and runs are checked on CPU tensors (the same calls; only ``non_blocking`` differs)."""
    import torch

    from inflight.runtime.worker.kv_copies import HostKV, _runs

    gen = torch.Generator().manual_seed(0)
    caches = [[(torch.randn(6, BS, 2, 3, generator=gen), torch.randn(6, BS, 2, 3, generator=gen))
               for _ in range(2)]]
    before = [(k.clone(), v.clone()) for k, v in caches[0]]
    host = HostKV(caches, num_slots=4)
    getattr(host, path)(KVCopies(copy_out=((0, 1), (5, 2)), copy_in=()))
    getattr(host, path)(KVCopies(copy_out=((1, 0),), copy_in=((0, 2), (1, 3), (2, 4))))
    for (k, v), (k0, v0) in zip(caches[0], before, strict=True):
        for t, t0 in ((k, k0), (v, v0)):
            assert torch.equal(t[2], t0[1]) and torch.equal(t[3], t0[0]) and torch.equal(t[4], t0[5])
            assert torch.equal(t[0], t0[0]) and torch.equal(t[1], t0[1])
    assert host.bytes_per_block == 2 * 2 * BS * 2 * 3 * 4
    assert _runs([(0, 1), (1, 2), (2, 3), (5, 4), (6, 5), (9, 9)]) == [(0, 1, 3), (5, 4, 2), (9, 9, 1)]
