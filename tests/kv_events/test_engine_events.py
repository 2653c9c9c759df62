"""A subscriber on real ZMQ sockets (127.0.0.1) follows a real (random-weight) engine: after a
burst of requests sharing prefixes, through evictions and preemptions, the block set it rebuilt
from the events (and the tokens and parents of each block) equals the pool's own prefix cache;
batches sent before it subscribed come from the replay socket; a reset clears both. A stalled
publisher (injected) and a subscriber that never reads cost the steps nothing."""

from __future__ import annotations

import json
import random
import threading

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.kv_events.events import external_hash
from inflight.runtime.sampling_params import SamplingParams
from tests.kv_events.subscriber import Subscriber

BLOCK = 4
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
                     "replay_endpoint": "tcp://*:0", "topic": "kv@127.0.0.1@demo"})


def _pool_view(engine: LLMEngine) -> dict[int, tuple[int, ...]]:
    """The pool's findable blocks: external hash -> the block's tokens."""
    pool = engine.pool
    return {external_hash(h): pool.block_tokens[b] for h, b in pool._cached.items()}


def _host_view(engine: LLMEngine) -> set[int]:
    """The host tier's blocks (empty without one): external hashes."""
    tier = engine.kv.host_tier
    return set() if tier is None else {external_hash(h) for h in tier.slot_hash if h is not None}


def _local(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


# sim: async scheduling, blocks cached a step later; offload: a host tier behind the pool (its
# blocks are "CPU" events, its evictions too), whose hits come back to the device cache (a GPU
# BlockStored again)
@pytest.mark.parametrize(("device", "offload"), [("cpu", None), ("sim", None), ("cpu", 0.0001), ("sim", 0.0001)],
                         ids=["cpu", "sim", "cpu-host-tier", "sim-host-tier"])
def test_a_subscriber_rebuilds_the_pools_block_set_through_evictions_and_preemptions(
        llama_dir, device: str, offload: float | None) -> None:
    config = EngineConfig(device=device, dtype="float32", block_size=BLOCK, num_kv_blocks=28, max_num_sequences=6,
                          max_num_tokens=64, max_model_len=80, kv_offloading_size=offload, kv_events_config=EVENTS)
    engine = LLMEngine.from_model_dir(llama_dir, config)
    stream = engine.kv_events
    assert stream is not None
    sub = Subscriber(_local(stream.publisher.endpoint), b"kv@")
    replay_at = _local(stream.publisher.replay_endpoint)
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, 200) for _ in range(n)] for n in (12, 9, 17)]
    try:
        for wave in range(3):
            for i in range(8):
                prompt = prefixes[i % 3] + [rng.randrange(3, 200) for _ in range(rng.randrange(1, 10))]
                params = SamplingParams(max_tokens=rng.randrange(16, 40), temperature=0.0, ignore_eos=True)
                engine.add_request(f"w{wave}-r{i}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
                if rng.random() < 0.2:  # mid-burst, in-flight requests hold blocks: still the same set
                    sub.drain(stream.publisher.next_seq - 1, replay_at)
                    assert sub.blocks.keys() == _pool_view(engine).keys()
                    assert sub.host == _host_view(engine)
            sub.drain(stream.publisher.next_seq - 1, replay_at)
            view = _pool_view(engine)
            assert sub.blocks.keys() == view.keys() and view
            assert sub.host == _host_view(engine)
            assert all(sub.blocks[h][1] == tokens for h, tokens in view.items())
        stats = engine.stats()
        assert stats.num_preemptions > 0, "the burst was meant to preempt"
        assert stats.prefix_cache_hits > 0, "the shared prefixes were meant to hit"
        if offload is not None:
            assert stats.kv_offload_loaded_blocks > 0, "the host tier was meant to serve hits"
            assert sub.host and sub.num_host_removed > 0, "the host tier was meant to fill and evict"
        assert sub.num_removed > 0, "the burst was meant to evict cached blocks"
        assert stream.publisher.num_dropped_batches == 0
        # Every chain's parent is a block the subscriber holds (or none, for a chain's first).
        assert all(p is None or p in sub.blocks for p, _ in sub.blocks.values())
        late = Subscriber(_local(stream.publisher.endpoint), b"kv@")  # joins after the burst
        try:  # everything it missed comes from the replay socket, and it reaches the same set
            assert late.drain(stream.publisher.next_seq - 1, replay_at) == stream.publisher.next_seq
            assert late.blocks == sub.blocks and late.host == sub.host
        finally:
            late.close()
        engine.pool.reset_prefix_cache()  # nothing runs: every cached block goes
        engine.step()  # idle step: the reset's event goes out with it
        sub.drain(stream.publisher.next_seq - 1, replay_at)
        assert sub.blocks == {} and _pool_view(engine) == {}
        assert sub.host == set() and _host_view(engine) == set()
    finally:
        sub.close()
        engine.close()
    assert not stream.publisher._thread.is_alive()


def test_a_stalled_publisher_and_a_subscriber_that_never_reads_do_not_hold_up_steps(llama_dir) -> None:
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "hwm": 1, "max_queue_size": 2})
    engine = LLMEngine.from_model_dir(llama_dir, EngineConfig(device="cpu", dtype="float32", block_size=BLOCK,
                                                              num_kv_blocks=28, kv_events_config=events))
    stream = engine.kv_events
    assert stream is not None
    deaf = Subscriber(_local(stream.publisher.endpoint))  # connected, never reads
    gate = threading.Event()
    stream.publisher.send_gate = gate  # injected: the publisher thread stalls before its next send
    try:
        for i in range(6):
            engine.add_request(f"r{i}", [3 + i] * 9, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():  # would hang if a step waited on the publisher
            engine.step()
        published = stream.publisher.next_seq
        assert published >= 5 and stream.publisher.num_dropped_batches >= published - 3  # queue 2, thread 1
    finally:
        gate.set()
        engine.close()
        deaf.close()
    assert not stream.publisher._thread.is_alive()
