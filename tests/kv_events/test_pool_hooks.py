"""The block pool's hooks, on the CPU without sockets: a block that becomes findable is stored
once (with its parent and tokens, its request's adapter), a duplicate is not, an eviction removes
it, and a reset clears everything when nothing is held, else removes just what it dropped."""

from __future__ import annotations

from inflight.runtime.core.block_pool import KVBlockPool, hash_block
from inflight.runtime.core.kv_manager import KVCacheManager
from inflight.runtime.core.request import Request
from inflight.runtime.kv_events.collector import KVEventCollector
from inflight.runtime.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, external_hash
from inflight.runtime.lora.types import LoRARef
from inflight.runtime.sampling_params import SamplingParams

BS = 2


def _pool(num_blocks: int = 4) -> tuple[KVBlockPool, KVCacheManager, KVEventCollector]:
    pool = KVBlockPool(num_blocks)
    pool.events = KVEventCollector(BS)
    return pool, KVCacheManager(pool, BS), pool.events


def _run(kv: KVCacheManager, req: Request) -> None:
    assert kv.allocate_slots(req, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)


def test_a_requests_full_blocks_go_out_as_one_chain_with_its_adapter() -> None:
    _, kv, events = _pool()
    req = Request("a", [1, 2, 3, 4, 5], SamplingParams(), lora=LoRARef("sql", 7, "sql:abc"))
    _run(kv, req)
    h = [external_hash(x) for x in req.block_hashes]
    assert events.take() == (BlockStored((h[0], h[1]), None, (1, 2, 3, 4), BS, 7, lora_name="sql"),)


def test_duplicates_are_not_stored_twice_and_evictions_and_resets_are_told() -> None:
    pool, kv, events = _pool(num_blocks=4)
    a = Request("a", [1, 2, 9], SamplingParams())
    b = Request("b", [1, 2, 8], SamplingParams())  # same first block, computed before a's is cached
    assert kv.allocate_slots(a, 3) and kv.allocate_slots(b, 3)
    for r in (a, b):
        r.num_computed_tokens = 3
        kv.cache_computed_blocks(r)
    first = external_hash(a.block_hashes[0])
    assert events.take() == (BlockStored((first,), None, (1, 2), BS),)  # b's copy is not findable: no event
    kv.free(a)
    kv.free(b)
    assert kv.allocate_slots(Request("c", [5, 6, 7, 8, 5, 6, 7, 8], SamplingParams()), 8)  # evicts everything
    assert events.take() == (BlockRemoved((first,)),)
    pool.reset_prefix_cache()
    assert events.take() == (AllBlocksCleared(),)  # nothing cached now


def test_a_reset_while_blocks_are_held_removes_only_the_free_ones() -> None:
    pool, kv, events = _pool(num_blocks=6)
    held = Request("held", [1, 2, 3], SamplingParams())
    gone = Request("gone", [7, 8, 9], SamplingParams())
    _run(kv, held)
    _run(kv, gone)
    events.take()
    kv.free(gone)
    pool.reset_prefix_cache()
    assert events.take() == (BlockRemoved((external_hash(gone.block_hashes[0]),)),)
    assert hash_block(pool.root_hash, [1, 2]) in pool._cached  # the held block stays findable
