"""KVEventStream: the engine's one handle on KV events: a collector the block pool fills and a
publisher that sends what it collected, once per engine step.

:func:`open_kv_event_stream` returns None when ``--kv-events-config`` is unset or does not
publish, so an engine without events pays nothing. Knows nothing about the engine's step.
"""

from __future__ import annotations

import threading

from inflight.runtime.kv_events.collector import KVEventCollector
from inflight.runtime.kv_events.config import parse_kv_events_config
from inflight.runtime.kv_events.publisher import ZmqEventPublisher


class KVEventStream:
    """A collector and its publisher; :meth:`flush` after each step, :meth:`close` at shutdown."""

    def __init__(self, collector: KVEventCollector, publisher: ZmqEventPublisher) -> None:
        self.collector = collector
        self.publisher = publisher

    def flush(self) -> None:
        """Publish the step's events, if there were any (never blocks; see the publisher)."""
        if len(self.collector):
            self.publisher.publish(self.collector.take())

    def close(self) -> None:
        self.flush()
        self.publisher.close()


def open_kv_event_stream(config_text: str | None, block_size: int, data_parallel_rank: int = 0,
                         send_gate: threading.Event | None = None) -> KVEventStream | None:
    """The stream ``config_text`` (``EngineConfig.kv_events_config``) asks for, or None."""
    if config_text is None:
        return None
    config = parse_kv_events_config(config_text)
    if not config.publishes:
        return None
    return KVEventStream(KVEventCollector(block_size), ZmqEventPublisher(config, data_parallel_rank, send_gate))
