"""KV events on the wire: our bytes are vLLM's (msgspec's encoding of structs mirroring
vllm/distributed/kv_events.py, and its typed decoder reads them back field by field); the
collector merges a chain's stores; the publisher sends topic, 8-byte sequence and payload on
real sockets, its replay socket serves missed batches, a stalled send never blocks a publish
(the stall is injected), and bad configs are refused with the key named."""

from __future__ import annotations

import hashlib
import threading

import msgpack
import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.kv_events.collector import KVEventCollector
from inflight.runtime.kv_events.config import KVEventsConfig, parse_kv_events_config
from inflight.runtime.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    encode_batch,
    external_hash,
)
from inflight.runtime.kv_events.publisher import ZmqEventPublisher
from tests.kv_events import vllm_structs as v
from tests.kv_events.subscriber import Subscriber, replay

TOP = 2**64 - 1


def _digest(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


def test_bytes_equal_vllms_encoder_and_decode_with_its_layout() -> None:
    ours = KVEventBatch(1757500000.25, (
        BlockStored((TOP, 7), None, tuple(range(32)), 16),
        BlockStored((5,), TOP, (128000, 65535, 65536, 0), 4, lora_id=3, lora_name="adapter"),
        BlockRemoved((0x8000000000000001, 7)),
        AllBlocksCleared(),
    ), 0)
    theirs = v.KVEventBatch(ts=1757500000.25, data_parallel_rank=0, events=[
        v.BlockStored(block_hashes=[TOP, 7], parent_block_hash=None, token_ids=list(range(32)), block_size=16,
                      lora_id=None, medium="GPU", lora_name=None),
        v.BlockStored(block_hashes=[5], parent_block_hash=TOP, token_ids=[128000, 65535, 65536, 0], block_size=4,
                      lora_id=3, medium="GPU", lora_name="adapter"),
        v.BlockRemoved(block_hashes=[0x8000000000000001, 7], medium="GPU"),
        v.AllBlocksCleared(),
    ])
    payload = encode_batch(ours)
    assert payload == v.ENCODER.encode(theirs)
    decoded = v.DECODER.decode(payload)
    assert decoded == theirs
    stored = decoded.events[0]
    assert (stored.block_hashes, stored.parent_block_hash, stored.block_size, stored.medium) == ([TOP, 7], None, 16, "GPU")
    # Positionally, as llm-d's VLLMAdapter reads it: [tag, hashes, parent, tokens, block_size, lora_id, medium, ...]
    raw = msgpack.unpackb(payload)
    assert raw[0] == 1757500000.25 and raw[2] == 0
    assert raw[1][1][:8] == ["BlockStored", [5], TOP, [128000, 65535, 65536, 0], 4, 3, "GPU", "adapter"]
    assert raw[1][2][:3] == ["BlockRemoved", [0x8000000000000001, 7], "GPU"] and raw[1][3] == ["AllBlocksCleared"]


def test_hashes_go_out_as_the_low_64_bits_of_the_digest() -> None:
    d = _digest("a")
    assert external_hash(d) == int.from_bytes(d, "big") & TOP == int.from_bytes(d[-8:], "big")


def test_the_collector_merges_a_chain_and_keeps_the_order() -> None:
    c = KVEventCollector(block_size=2)
    a, b, x, y = (_digest(s) for s in "abxy")
    c.stored(a, None, [1, 2])
    c.stored(b, a, [3, 4])  # continues the chain: merged
    c.stored(x, None, [5, 6])  # a new chain
    c.removed(y)
    c.removed(a)
    c.stored(_digest("z"), b, [7, 8])  # after a removal: its own event
    events = c.take()
    ea, eb, ex = external_hash(a), external_hash(b), external_hash(x)
    assert events == (BlockStored((ea, eb), None, (1, 2, 3, 4), 2), BlockStored((ex,), None, (5, 6), 2),
                      BlockRemoved((external_hash(y), ea)), BlockStored((external_hash(_digest("z")),), eb, (7, 8), 2))
    assert c.take() == ()
    c.stored(a, None, [1, 2])
    c.cleared()
    assert c.take() == (AllBlocksCleared(),)


def _local(endpoint: str) -> str:
    return endpoint.replace("0.0.0.0", "127.0.0.1")


def _batch(i: int) -> tuple:
    return (BlockStored((i,), None, (i, i), 2),)


def test_batches_reach_a_subscriber_with_topic_and_sequence_and_replay_serves_missed_ones() -> None:
    pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://*:0", "tcp://*:0", buffer_steps=4,
                                           topic="kv@10.0.0.7@demo"))
    sub = Subscriber(_local(pub.endpoint), b"kv@")
    try:
        pub.publish(_batch(0))
        got = None
        for i in range(1, 50):  # PUB drops what it sends before the subscription arrives
            got = sub.receive(200)
            if got is not None:
                break
            pub.publish(_batch(i))
        assert got is not None and sub.topics == {b"kv@10.0.0.7@demo"}
        first = got[0]
        for i in range(first + 1, first + 6):
            pub.publish(_batch(i))
        seqs = [got[0]] + [sub.receive()[0] for _ in range(5)]
        assert seqs == list(range(first, first + 6))  # in order, none lost once subscribed
        last = first + 5
        # The replay socket keeps the last buffer_steps (4) batches, from the asked sequence on.
        missed = replay(_local(pub.replay_endpoint), last - 2)
        assert [s for s, _ in missed] == [last - 2, last - 1, last]
        assert [b.events[0].block_hashes for _, b in missed] == [[last - 2], [last - 1], [last]]
        assert [s for s, _ in replay(_local(pub.replay_endpoint), 0)] == list(range(last - 3, last + 1))
        assert replay(_local(pub.replay_endpoint), last + 1) == []
    finally:
        sub.close()
        pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(_batch(0))


def test_a_stalled_send_never_blocks_a_publish_and_drops_are_counted_as_gaps() -> None:
    gate = threading.Event()  # cleared: the publisher thread stalls before its first send
    pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://*:0", "tcp://*:0", max_queue_size=2), send_gate=gate)
    try:
        accepted = [pub.publish(_batch(i)) for i in range(10)]  # would hang here if a publish waited
        # The stalled thread holds at most one batch and the queue two: the rest were dropped.
        assert 7 <= pub.num_dropped_batches <= 8 and accepted.count(False) == pub.num_dropped_batches
        assert accepted[:2] == [True, True] and pub.next_seq == 10
        gate.set()
        kept = [i for i, ok in enumerate(accepted) if ok]
        for _ in range(200):  # the thread sends what it kept; the replay buffer shows it
            got = [s for s, _ in replay(_local(pub.replay_endpoint), 0)]
            if got == kept:
                break
        assert got == kept  # the dropped batches' sequence numbers are missing: a subscriber sees the gap
    finally:
        pub.close()


def test_close_returns_even_while_a_send_is_stalled() -> None:
    gate = threading.Event()
    pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://*:0"), send_gate=gate)
    pub.publish(_batch(0))
    pub.close()  # releases the injected stall, drains, closes the sockets
    assert not pub._thread.is_alive()


@pytest.mark.parametrize(("text", "said"), [
    ("{", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
    ('{"publisher": "kafka"}', "publisher must be one of zmq, null"),
    ('{"endpoint": "http://x:1"}', "endpoint must be a ZMQ address"),
    ('{"endpoint": "tcp://x"}', "tcp://HOST:PORT"),
    ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ('{"hwm": -1}', "hwm must be an integer >= 0"),
    ('{"max_queue_size": true}', "max_queue_size must be an integer"),
    ('{"topic": 5}', "topic must be text"),
    ('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5557"}',
     "must differ from endpoint"),
    ('{"enable_kv_cache_events": true, "bogus": 1}', "unknown key(s) bogus"),
])
def test_bad_config_is_refused_naming_the_key(text: str, said: str) -> None:
    with pytest.raises(ValueError, match="kv_events_config") as exc:
        EngineConfig(kv_events_config=text)
    assert said in str(exc.value)


def test_config_defaults_follow_vllm() -> None:
    assert parse_kv_events_config("{}") == KVEventsConfig()  # off, publisher null
    on = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert on.publishes and on.publisher == "zmq" and on.endpoint == "tcp://*:5557" and on.buffer_steps == 10_000
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').publishes


def test_an_endpoint_in_use_is_a_clear_error() -> None:
    first = ZmqEventPublisher(KVEventsConfig(True, "zmq", "tcp://*:0"))
    try:
        port = first.endpoint.rsplit(":", 1)[1]
        with pytest.raises(ValueError, match="cannot open"):
            ZmqEventPublisher(KVEventsConfig(True, "zmq", f"tcp://*:{port}"))
    finally:
        first.close()
