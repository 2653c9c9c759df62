"""The host tier's KV events (medium "CPU"), on the CPU without sockets: a block the device pool
evicts into the tier goes out as a hashes-only ``BlockStored`` (vLLM's offloading connector's
form) before the device's ``BlockRemoved``, a block the tier evicts as a ``BlockRemoved``, a reset
clears both tiers; merging never moves an event past another that mentions the same hash."""

from __future__ import annotations

from inflight.runtime.core.block_pool import KVBlockPool
from inflight.runtime.core.host_tier import HostTier
from inflight.runtime.core.kv_manager import KVCacheManager
from inflight.runtime.core.request import Request
from inflight.runtime.kv_events.collector import KVEventCollector
from inflight.runtime.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    external_hash,
)
from inflight.runtime.sampling_params import SamplingParams
from tests.kv_events import vllm_structs as v

BS = 2


def _setup(num_blocks: int = 4, num_slots: int = 8) -> tuple[KVBlockPool, KVCacheManager, KVEventCollector]:
    pool = KVBlockPool(num_blocks)
    kv = KVCacheManager(pool, BS, host_tier=HostTier(num_slots))
    pool.events = KVEventCollector(BS)  # set after the tier: the pool hands it on
    return pool, kv, pool.events


def _run(kv: KVCacheManager, req: Request) -> list[int]:
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    hashes = [external_hash(h) for h in req.block_hashes]
    kv.free(req)
    return hashes


def _sets(events: tuple, gpu: set[int], cpu: set[int]) -> None:
    """Apply ``events`` to per-medium sets, as a router does."""
    for e in events:
        if isinstance(e, AllBlocksCleared):
            gpu.clear()
            cpu.clear()
            continue
        target = cpu if e.medium == "CPU" else gpu
        for h in e.block_hashes:
            if isinstance(e, BlockStored):
                assert h not in target
                target.add(h)
            else:
                target.remove(h)


def test_an_evicted_block_is_stored_on_the_host_before_it_leaves_the_device() -> None:
    _, kv, events = _setup(num_blocks=4)
    a = _run(kv, Request("a", [1, 2, 3, 4, 5], SamplingParams()))  # two full blocks cached
    assert events.take() == (BlockStored(tuple(a), None, (1, 2, 3, 4), BS),)
    assert kv.allocate_slots(Request("b", [9] * 8, SamplingParams()), 8)  # evicts both
    tier = kv.host_tier
    assert tier is not None
    # a's tail was freed first (evicted first); one hashes-only CPU store, then one GPU removal
    assert events.take() == (BlockStored((a[1], a[0]), None, (), 0, None, "CPU"), BlockRemoved((a[1], a[0])))
    # The bytes are vLLM's (msgspec's encoding of its structs) for the offloading connector's events
    payload = encode_batch(KVEventBatch(1.0, (BlockStored((a[0],), None, (), 0, None, "CPU"),
                                              BlockRemoved((a[1],), "CPU"))))
    theirs = v.KVEventBatch(ts=1.0, events=[
        v.BlockStored(block_hashes=[a[0]], parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                      medium="CPU", lora_name=None),
        v.BlockRemoved(block_hashes=[a[1]], medium="CPU"),
    ])
    assert payload == v.ENCODER.encode(theirs) and v.DECODER.decode(payload) == theirs


def test_the_tiers_own_evictions_go_out_and_a_subscriber_keeps_both_sets() -> None:
    pool, kv, events = _setup(num_blocks=3, num_slots=2)
    gpu: set[int] = set()
    cpu: set[int] = set()
    for i in range(6):  # each request evicts the one before; the 2-slot tier evicts too
        _run(kv, Request(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4, 7], SamplingParams()))
        _sets(events.take(), gpu, cpu)
        tier = kv.host_tier
        assert tier is not None
        assert gpu == {external_hash(h) for h in pool._cached}
        assert cpu == {external_hash(h) for h in tier.slot_hash if h is not None}
    assert tier.num_evicted_blocks > 0 and len(cpu) == 2
    pool.reset_prefix_cache()  # nothing held, nothing pinned: both tiers empty
    assert events.take() == (AllBlocksCleared(),)


def test_a_reset_keeps_a_pinned_host_block_and_removes_the_rest() -> None:
    pool, kv, events = _setup(num_blocks=3, num_slots=4)
    a = _run(kv, Request("a", [1, 2, 3, 4, 5], SamplingParams()))
    _run(kv, Request("b", [6, 6, 6, 6, 5], SamplingParams()))  # a's blocks go to the host
    events.take()
    tier = kv.host_tier
    assert tier is not None
    tier.pin([tier._lru[next(h for h in tier._lru if external_hash(h) == a[0])]])  # a copy-in reads it
    pool.reset_prefix_cache()
    gone = events.take()
    assert AllBlocksCleared() not in gone
    assert BlockRemoved((a[1],), "CPU") in gone
    assert a[0] not in {h for e in gone for h in getattr(e, "block_hashes", ())}


def test_merging_never_moves_an_event_past_another_on_the_same_hash() -> None:
    events = KVEventCollector(BS)
    h1, h2 = bytes(31) + b"\x01", bytes(31) + b"\x02"
    events.host_stored(h1)
    events.host_removed(h1)
    events.host_stored(h1)  # cannot join the first store: the removal in between mentions h1
    events.host_stored(h2)  # joins the open store
    events.host_removed(h2)
    assert events.take() == (BlockStored((1,), None, (), 0, None, "CPU"), BlockRemoved((1,), "CPU"),
                             BlockStored((1, 2), None, (), 0, None, "CPU"), BlockRemoved((2,), "CPU"))
