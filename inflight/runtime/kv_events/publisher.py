"""ZmqEventPublisher: sends each step's KV events on a ZMQ PUB socket from a background thread.

The wire is vLLM's ``ZmqEventPublisher``'s: every batch is a three-frame message (topic, an
8-byte big-endian sequence number, the msgpack payload of :func:`events.encode_batch`); with a
``replay_endpoint`` a ROUTER socket answers a request ``[identity, b"", start_seq]`` (8 bytes,
big-endian) with every batch still buffered (the last ``buffer_steps``) from ``start_seq`` on, one
``[identity, b"", seq, payload]`` each, then ``[identity, b"", -1 as 8 signed bytes, b""]``.

The engine never waits on it: :meth:`publish` puts the batch on a bounded queue
(``max_queue_size``) without blocking; when the queue is full the batch is dropped and counted
(``num_dropped_batches``). Sequence numbers are drawn when a batch is published, so a dropped
batch leaves a gap a subscriber can see. A slow or absent subscriber costs nothing either: the
PUB socket drops at its high-water mark (``hwm``) and never blocks. ``send_gate`` is a fault
hook for tests (when set to an Event, the publisher thread waits on it before each send: a
cleared one injects a stalled send). Only this module imports ``zmq``.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

from inflight.runtime.kv_events.config import KVEventsConfig, binds
from inflight.runtime.kv_events.events import KVCacheEvent, KVEventBatch, encode_batch

logger = logging.getLogger("inflight.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # how long the thread waits for a batch before looking at the replay socket again


class ZmqEventPublisher:
    """See module docstring. ``close()`` sends what is queued (up to ``drain_timeout_s``) and stops."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0,
                 send_gate: threading.Event | None = None) -> None:
        import zmq  # only when events are published

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.num_dropped_batches = 0
        self.num_sent_batches = 0
        self.send_gate = send_gate
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self.next_seq = 0  # the sequence number of the next batch published
        self._topic = config.topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {config.endpoint!r}"
                             f"{' / ' + repr(config.replay_endpoint) if config.replay_endpoint else ''}: {exc}") from None
        # The sockets' addresses (the port a ``tcp://*:0`` bind picked), read before the thread owns them.
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint: str | None = (None if self._replay is None
                                            else self._replay.getsockopt_string(zmq.LAST_ENDPOINT))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()

    def publish(self, events: tuple[KVCacheEvent, ...]) -> bool:
        """Queue one step's events (never blocks); False when the queue was full and they were dropped."""
        if self._stop.is_set():
            raise RuntimeError("the KV event publisher is closed")
        batch = KVEventBatch(time.time(), events, self.data_parallel_rank)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            self.num_dropped_batches += 1
            if self.num_dropped_batches == 1 or self.num_dropped_batches % 1000 == 0:
                logger.warning("KV event queue full (%d batches): %d batch(es) dropped so far",
                               self.config.max_queue_size, self.num_dropped_batches)
            return False
        return True

    def close(self, drain_timeout_s: float = 1.0) -> None:
        """Stop taking batches, send those queued (for at most ``drain_timeout_s``), close the sockets."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self.send_gate is not None:
            self.send_gate.set()  # a test's injected stall must not keep the thread alive
        try:
            self._queue.put(None, timeout=drain_timeout_s)
        except queue.Full:
            pass  # the thread sees _stop and ends after its current batch
        self._thread.join(timeout=drain_timeout_s)
        if self._thread.is_alive():
            logger.warning("KV event publisher thread still sending after %.1fs; closing anyway", drain_timeout_s)
            return  # the daemon thread owns the sockets until it ends
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    # -- the publisher thread -----------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if item is None:
                return
            if self.send_gate is not None:
                self.send_gate.wait()
            seq, batch = item
            try:
                payload = encode_batch(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 - a failed send loses one batch, never the thread
                logger.exception("KV event batch %d not sent", seq)
                continue
            self._buffer.append((seq, payload))
            self.num_sent_batches += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))
