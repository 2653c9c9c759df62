"""Per-group KV tables without a model: the layer grouping, and the grouped manager on a pool.

A request holds one table per group from one pool; a windowed group gives back what falls wholly
before its window, a full group keeps everything; allocation is all-or-nothing over the groups;
finish, abort and preemption give every block back; a prefix hit is taken only where every group
has the blocks it needs cached.
"""

from __future__ import annotations

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.block_pool import KVBlockPool
from inflight.runtime.core.kv_groups import GroupedKVCacheManager, GroupHit, group_key
from inflight.runtime.core.kv_manager import cdiv
from inflight.runtime.core.request import Request, RequestStatus
from inflight.runtime.core.scheduler import Scheduler
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.kv_layout import group_layers

W, BS = 8, 4
WINDOWS = (None, W)  # gpt-oss: a full group and a sliding one


def _req(req_id: str, n: int, first: int = 5) -> Request:
    return Request(req_id, list(range(first, first + n)), SamplingParams(max_tokens=1000), arrival_time=0.0)


def _manager(num_blocks: int = 64, caching: bool = True, windows=WINDOWS) -> GroupedKVCacheManager:
    return GroupedKVCacheManager(KVBlockPool(num_blocks, caching), BS, windows)


def _compute(kv: GroupedKVCacheManager, req: Request, n: int) -> None:
    """What the engine does for a chunk of ``n`` tokens: allocate, compute, register, release."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)
    kv.release_out_of_window(req)


# -- grouping -----------------------------------------------------------------------------
def test_gemma3_layers_group_in_fours_with_two_padding_slots():
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # Gemma 3 27B-like: 22 local, 4 global
    layout = group_layers(windows)
    assert layout is not None and layout.num_slots == 4
    assert layout.windows == (None,) + (512,) * 6 and layout.num_padding_layers == 2
    # every layer has one (group, slot), and no two layers share one
    assert len(set(zip(layout.layer_group, layout.layer_slot, strict=True))) == 26
    assert all(layout.windows[layout.layer_group[i]] == w for i, w in enumerate(windows))


def test_alternating_layers_make_two_groups_without_padding():
    layout = group_layers([128 if i % 2 == 0 else None for i in range(24)])  # gpt-oss
    assert layout is not None and layout.windows == (None, 128) and layout.num_slots == 12
    assert layout.num_padding_layers == 0


def test_one_attention_type_is_not_grouped():
    assert group_layers([None] * 4) is None and group_layers([16] * 4) is None


# -- the manager on a pool ----------------------------------------------------------------
def test_windowed_group_frees_what_leaves_its_window_and_full_group_keeps_all():
    kv = _manager()
    req = _req("a", 20)
    _compute(kv, req, 20)
    for _ in range(200 - 20):
        req.append_token(7)  # the sampled token, whose KV the next step writes
        _compute(kv, req, 1)
        full, sliding = kv.blocks_held_by_group([req])
        assert full == cdiv(req.num_computed_tokens, BS)
        assert sliding <= cdiv(W - 1, BS) + 2  # the window's blocks + the one being filled
    full, sliding = kv.blocks_held_by_group([req])
    assert kv.pool.num_used_blocks == full + sliding == 50 + sliding
    assert len(req.group_block_ids[0]) == len(req.group_block_ids[1]) == 50  # placeholders kept
    kv.free(req)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    kv.pool.check_invariants()


def test_allocation_is_all_or_nothing_over_the_groups():
    kv = _manager(num_blocks=9)
    req = _req("a", 16)
    assert not kv.allocate_slots(req, 20)  # 5 blocks a group: 10 > 9
    assert req.block_ids == [] and kv.pool.num_free_blocks == 9
    assert kv.blocks_needed(req, 20) == 10
    assert kv.allocate_slots(req, 16)  # 4 a group
    assert [len(t) for t in req.group_block_ids] == [4, 4] and kv.pool.num_free_blocks == 1
    kv.free(req)
    assert kv.pool.num_free_blocks == 9


def test_prefix_hit_needs_every_group():
    kv = _manager()
    a = _req("a", 41)
    _compute(kv, a, 41)
    kv.free(a)  # its 10 full blocks a group stay cached
    b = _req("b", 41)
    hit = kv.find_prefix_hit(b)
    assert isinstance(hit, GroupHit) and len(hit) == 10
    # the sliding group needs only the blocks of its window before position 40 (36 .. 39 and 33 ..)
    skip = (10 * BS - W + 1) // BS
    assert hit.groups[1][:skip] == [None] * skip and None not in hit.groups[1][skip:]
    assert kv.allocate_slots(b, 1, hit)
    assert b.num_computed_tokens == 40 and b.group_released == [0, skip]
    assert kv.blocks_held_by_group([b]) == (11, 10 - skip + 1)
    kv.free(b)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_a_windowed_block_missing_from_the_cache_shortens_the_hit():
    kv = _manager()
    a = _req("a", 41)
    _compute(kv, a, 41)
    kv.free(a)
    # evict the sliding group's block 9 (positions 36 .. 39): a hit of 10 blocks would read it
    b = _req("b", 41)
    b.block_hashes = kv._hashes(b, b.token_ids)
    block = kv.pool.find_block(group_key(b.block_hashes[9], 1), b.token_ids[36:40])
    assert block is not None
    kv.pool.share([block])
    kv.pool._evict(block)
    kv.pool.free([block])
    hit = kv.find_prefix_hit(_req("c", 41))
    assert len(hit) == 9  # the longest prefix whose window is still cached in every group


class _Events:
    """A KV-event collector that records the keys it hears of."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []

    def stored(self, block_hash, *_rest) -> None:
        self.keys.append(block_hash)

    def removed(self, block_hash) -> None:
        self.keys.append(block_hash)


def test_group_keys_differ_and_are_not_announced():
    kv = _manager()
    events = _Events()
    kv.pool.events = events
    a = _req("a", 9)
    _compute(kv, a, 9)
    assert events.keys == a.block_hashes[:2]  # group 0's plain keys only
    assert group_key(a.block_hashes[0], 1) != a.block_hashes[0]
    kv.free(a)
    kv.pool.allocate(kv.pool.num_free_blocks)  # evicts every cached block: the group's keys are not told either
    assert sorted(events.keys) == sorted(a.block_hashes[:2] * 2)


# -- the scheduler over a grouped manager -------------------------------------------------
def _schedule_all(sched: Scheduler, kv: GroupedKVCacheManager, steps: int = 400) -> int:
    """Run steps as the engine would (tokens appended, blocks cached and released); preemptions."""
    for _ in range(steps):
        out = sched.schedule()
        if out.is_empty and not sched.has_unfinished():
            break
        for chunk in out.chunks:
            req = sched.requests[chunk.req_id]
            req.num_computed_tokens += chunk.num_tokens
            kv.cache_computed_blocks(req)
            kv.release_out_of_window(req)
            assert chunk.group_tables is not None and chunk.group_tables[0] == chunk.block_table
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(7)
                if req.num_output_tokens >= 30:
                    sched.remove(req)
        kv.pool.check_invariants()
    return sched.num_preemptions


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_and_finish_leak_nothing(caching):
    kv = _manager(num_blocks=40, caching=caching)
    config = EngineConfig(device="cpu", max_num_tokens=64, num_kv_blocks=20, block_size=BS,
                          enable_prefix_caching=caching)
    sched = Scheduler(config, kv)
    for i in range(6):
        sched.add(_req(str(i), 30, first=5 + 3 * i))
    assert _schedule_all(sched, kv) > 0
    assert not sched.has_unfinished()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_abort_frees_every_group():
    kv = _manager()
    sched = Scheduler(EngineConfig(device="cpu", max_num_tokens=64, num_kv_blocks=32, block_size=BS), kv)
    req = _req("a", 30)
    sched.add(req)
    sched.schedule()
    assert req.status is RequestStatus.RUNNING and kv.pool.num_used_blocks == 2 * cdiv(30, BS)
    sched.remove(req)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks and req.group_block_ids is None
