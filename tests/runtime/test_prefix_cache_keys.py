"""Prefix-cache keys cannot be forged: SHA-256 chains from a random root per pool, and a hit
is checked against the block's own token ids, so even a forced key collision never serves one
prompt's KV to another (the attack behind vLLM's GHSA-rm76-4mrf-v9r8, which Python's public
``hash`` of a tuple made a few minutes of work against this server)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.runtime.config import EngineConfig
from inflight.runtime.core import block_pool
from inflight.runtime.core.block_pool import KVBlockPool, hash_block, hash_full_blocks
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams

BLOCK = 16


@given(st.lists(st.integers(0, 2**31), min_size=BLOCK, max_size=BLOCK), st.integers(0, BLOCK - 1),
       st.integers(1, 2**31))  # fmt: skip
@settings(max_examples=200, deadline=None)
def test_any_changed_token_changes_the_key(tokens: list[int], where: int, delta: int) -> None:
    other = list(tokens)
    other[where] += delta
    root = bytes(32)
    assert hash_block(root, tokens) != hash_block(root, other)
    assert len(hash_block(root, tokens)) == 32


def test_keys_chain_and_depend_on_the_pool_root() -> None:
    tokens = list(range(3 * BLOCK))
    a, b = KVBlockPool(4), KVBlockPool(4)
    assert a.root_hash != b.root_hash  # random per pool: keys cannot be precomputed offline
    keys_a = hash_full_blocks(tokens, BLOCK, root=a.root_hash)
    assert keys_a == hash_full_blocks(tokens, BLOCK, root=a.root_hash)  # deterministic in a pool
    assert keys_a != hash_full_blocks(tokens, BLOCK, root=b.root_hash)
    same_block_other_parent = hash_full_blocks([7] * BLOCK + tokens[BLOCK : 2 * BLOCK], BLOCK, root=a.root_hash)
    assert same_block_other_parent[1] != keys_a[1]  # a block's key covers everything before it


def test_a_colliding_key_is_a_miss_not_a_hit() -> None:
    pool = KVBlockPool(4)
    victim = list(range(BLOCK))
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"same key", victim)
    attacker = [t + 1 for t in victim]
    assert pool.find_cached([b"same key"], attacker, BLOCK) == []
    assert pool.find_cached([b"same key"], victim, BLOCK) == [block]


def _generate(model_dir, prompts, enable_prefix_caching: bool) -> tuple[dict[str, list[int]], LLMEngine]:
    config = EngineConfig(device="cpu", num_kv_blocks=64, block_size=BLOCK, max_num_tokens=256,
                          enable_prefix_caching=enable_prefix_caching)  # fmt: skip
    engine = LLMEngine.from_model_dir(model_dir, config)
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):  # one at a time: each later prompt looks up the cache
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        while engine.has_unfinished_requests():
            for o in engine.step():
                out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return out, engine


def test_every_key_colliding_still_serves_each_prompt_its_own_kv(model_factory, monkeypatch) -> None:
    """The strongest collision there is: every block of every prompt gets the same key. The
    "attacker" prompt goes first and fills the cache; each later prompt must still get exactly
    what it gets with no prefix cache at all, and shared prefixes must still hit."""
    model_dir = model_factory("llama")
    attacker = [(5 * i) % 500 + 3 for i in range(3 * BLOCK + 2)]
    victims = [[(7 * i + k) % 500 + 3 for i in range(2 * BLOCK + 5)] for k in range(3)]
    shared = attacker[: 2 * BLOCK] + [9, 9, 9]  # a real shared prefix of two blocks
    prompts = [attacker, *victims, shared]
    want, _ = _generate(model_dir, prompts, enable_prefix_caching=False)
    monkeypatch.setattr(block_pool, "hash_block", lambda parent, token_ids: b"collide")
    got, engine = _generate(model_dir, prompts, enable_prefix_caching=True)
    assert got == want
    stats = engine.stats()
    # The genuine prefix hits its first block only: with one key for everything, the key maps
    # to the first block ever cached, whose tokens the shared prompt's second block is not.
    assert stats.prefix_cache_hits == BLOCK
    assert stats.num_used_kv_blocks == 0


@pytest.mark.parametrize("block_size", [1, 16])
def test_hashing_accepts_every_valid_token_id(block_size: int) -> None:
    keys = hash_full_blocks([0, 1, 2**31 - 1, 151_935] * 4, block_size)
    assert len(keys) == 16 // block_size and len(set(keys)) == len(keys)
