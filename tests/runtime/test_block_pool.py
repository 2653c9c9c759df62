"""Property-based tests of the KV block pool: random interleavings keep ref counts consistent."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from inflight.runtime.core.block_pool import KVBlockPool, hash_full_blocks

NUM_BLOCKS = 16


class PoolMachine(RuleBasedStateMachine):
    """Sequences own lists of blocks; the model of truth is who holds what."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = KVBlockPool(NUM_BLOCKS, enable_prefix_caching=True)
        self.seqs: dict[int, list[int]] = {}
        self.next_id = 0

    def _held(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for blocks in self.seqs.values():
            for b in blocks:
                counts[b] = counts.get(b, 0) + 1
        return counts

    @rule(n=st.integers(1, 6))
    def allocate(self, n: int) -> None:
        in_use = set(self._held())
        blocks = self.pool.allocate(n)
        if n > NUM_BLOCKS - len(in_use):
            assert blocks is None
            return
        assert blocks is not None and len(blocks) == n and len(set(blocks)) == n
        assert not in_use & set(blocks), "handed out a block in use"
        self.seqs[self.next_id] = blocks
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def append(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        in_use = set(self._held())
        blocks = self.pool.allocate(1)
        if blocks is not None:
            assert blocks[0] not in in_use
            self.seqs[seq].extend(blocks)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def cache_and_share(self, data) -> None:
        """Register a sequence's blocks in the cache, then a new sequence finds and shares them."""
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        blocks = self.seqs[seq]
        tokens = [seq * 1000 + i for i in range(len(blocks) * 4)]
        hashes = hash_full_blocks(tokens, 4)
        for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
            self.pool.cache_block(b, h, tokens[4 * i : 4 * i + 4])
        hits = self.pool.find_cached(hashes, tokens, 4)
        if hits:
            self.pool.share(hits)
            self.seqs[self.next_id] = list(hits)
            self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        self.pool.free(self.seqs.pop(seq))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), keep=st.integers(0, 3))
    def abort_partially_shared(self, data, keep: int) -> None:
        """A sequence aborted mid-way: it drops all it holds, shared or not."""
        seq = data.draw(st.sampled_from(sorted(self.seqs)))
        blocks = self.seqs.pop(seq)
        self.pool.free(blocks[:keep] + blocks[keep:])

    @invariant()
    def ref_counts_match_holders(self) -> None:
        self.pool.check_invariants()
        held = self._held()
        for b in range(NUM_BLOCKS):
            assert self.pool.ref_cnt[b] == held.get(b, 0)
        assert self.pool.num_free_blocks == NUM_BLOCKS - len(held)

    def teardown(self) -> None:
        for blocks in self.seqs.values():
            self.pool.free(blocks)
        assert self.pool.num_free_blocks == NUM_BLOCKS
        self.pool.check_invariants()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    pool = KVBlockPool(4)
    a = pool.allocate(2)
    tokens = list(range(8))
    hashes = hash_full_blocks(tokens, 4)
    for i, (b, h) in enumerate(zip(a, hashes, strict=True)):
        pool.cache_block(b, h, tokens[4 * i : 4 * i + 4])
    pool.free(a)
    assert pool.find_cached(hashes, tokens, 4) == a, "freed full blocks stay findable"
    pool.allocate(2)  # takes the two never-used blocks first
    assert pool.find_cached(hashes, tokens, 4) == a
    pool.allocate(1)  # now an LRU eviction: the tail block of `a` was freed first
    assert pool.find_cached(hashes, tokens, 4) == [a[0]]


def test_double_free_is_caught():
    pool = KVBlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    try:
        pool.free(blocks)
    except RuntimeError as exc:
        assert "double free" in str(exc)
    else:
        raise AssertionError("double free went unnoticed")
