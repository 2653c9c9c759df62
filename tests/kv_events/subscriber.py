"""A test subscriber on real ZMQ sockets: receives batches (topic, sequence, payload), decodes
them with msgspec and vLLM's field layout, asks the replay socket for missed ones, and rebuilds
a publisher's sets of findable block hashes from the events, one per medium (``blocks``: the
device pool's, ``"GPU"``; ``host``: the host tier's, ``"CPU"``), as llm-d's indexer would."""

from __future__ import annotations

import zmq

from tests.kv_events.vllm_structs import DECODER, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class Subscriber:
    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hash -> (parent, tokens)
        self.last_seq = -1
        self.topics: set[bytes] = set()
        self.num_removed = 0  # blocks removed by BlockRemoved events
        self.host: set[int] = set()  # the host tier's blocks (medium "CPU")
        self.num_host_removed = 0
        self._seen: set[int] = set()  # every hash a device store has told the tokens of

    def receive(self, timeout_ms: int = 5000) -> tuple[int, KVEventBatch] | None:
        """The next batch (its sequence number and decoded payload); None when none came in time."""
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        self.topics.add(topic)
        return int.from_bytes(seq, "big"), DECODER.decode(payload)

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        assert seq == self.last_seq + 1, f"sequence gap: {self.last_seq} -> {seq}"
        self.last_seq = seq
        for event in batch.events:
            if isinstance(event, BlockStored) and event.medium == "CPU":
                # vLLM's offloading connector's form: hashes only, resolved through a device store
                assert event.token_ids == [] and event.block_size == 0 and event.parent_block_hash is None
                for h in event.block_hashes:
                    assert h in self._seen, "a host block whose tokens no device store told"
                    assert h not in self.host, "a host block stored twice"
                    self.host.add(h)
            elif isinstance(event, BlockRemoved) and event.medium == "CPU":
                for h in event.block_hashes:
                    assert h in self.host, "an unknown host block removed"
                    self.host.remove(h)
                    self.num_host_removed += 1
            elif isinstance(event, BlockStored):
                assert event.medium == "GPU"
                n = len(event.block_hashes)
                assert len(event.token_ids) == n * event.block_size
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    assert parent is None or parent in self.blocks, "a stored block's parent is unknown"
                    assert h not in self.blocks, "a block stored twice"
                    self.blocks[h] = (parent, tuple(event.token_ids[i * event.block_size:(i + 1) * event.block_size]))
                    self._seen.add(h)
                    parent = h
            elif isinstance(event, BlockRemoved):
                assert event.medium == "GPU"
                for h in event.block_hashes:
                    assert h in self.blocks, "an unknown block removed"
                    del self.blocks[h]
                    self.num_removed += 1
            else:
                assert isinstance(event, AllBlocksCleared)
                self.blocks.clear()
                self.host.clear()

    def drain(self, until_seq: int, replay_endpoint: str | None = None, timeout_ms: int = 5000) -> int:
        """Apply batches until ``until_seq`` is applied. Batches published before the
        subscription took hold (PUB drops them) come from ``replay_endpoint``: on a gap, or when
        nothing arrives. Returns how many batches came by replay."""
        replayed = idle = 0
        while self.last_seq < until_seq:
            before = self.last_seq
            got = self.receive(timeout_ms if replay_endpoint is None else 500)
            idle = idle + 1 if got is None else 0
            assert idle < 20, f"no batch after {before} (waiting for {until_seq}), not even by replay"
            if got is None and replay_endpoint is None:
                raise AssertionError(f"no batch after {self.last_seq} (waiting for {until_seq})")
            if got is not None and got[0] <= self.last_seq:
                continue  # already applied from the replay
            if replay_endpoint is not None and (got is None or got[0] > self.last_seq + 1):
                for missed_seq, missed in replay(replay_endpoint, self.last_seq + 1):
                    if missed_seq > self.last_seq:
                        self.apply(missed_seq, missed)
                        replayed += 1
                if got is None or got[0] <= self.last_seq:
                    continue
            self.apply(*got)
        return replayed

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def replay(endpoint: str, start_seq: int, timeout_ms: int = 5000) -> list[tuple[int, KVEventBatch]]:
    """Ask a replay socket for every batch from ``start_seq`` (a DEALER, as vLLM's REQ clients)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        out = []
        while True:
            assert sock.poll(timeout_ms), "the replay socket did not answer"
            _, seq, payload = sock.recv_multipart()
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                assert payload == b""
                return out
            out.append((n, DECODER.decode(payload)))
    finally:
        sock.close(linger=0)
        ctx.term()
