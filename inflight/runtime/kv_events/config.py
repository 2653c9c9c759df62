"""``--kv-events-config``: vLLM's ``KVEventsConfig``, parsed from its JSON text with clear errors.

The fields, their names and defaults are vLLM's (``vllm/config/kv_events.py``):
``enable_kv_cache_events``, ``publisher`` (``"zmq"`` or ``"null"``; unset: zmq when enabled),
``endpoint`` (a ``*`` or ``::`` host, ``ipc://`` or ``inproc://`` is bound, any other address is
connected to), ``replay_endpoint`` (a ROUTER bound there serves missed batches), ``buffer_steps``
(batches kept for replay), ``hwm`` (the PUB socket's high-water mark), ``max_queue_size``
(batches waiting for the publisher thread; beyond it a step's batch is dropped and counted,
never waited for) and ``topic``. Knows nothing about sockets or the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

PUBLISHERS = ("zmq", "null")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        """Whether events are collected and sent (enabled, with the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The config a ``--kv-events-config`` JSON object describes; ``ValueError`` naming the key."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"kv_events_config is not valid JSON ({exc}); give an object such as "
                         '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}.') from None
    if not isinstance(raw, dict):
        raise ValueError(f"kv_events_config must be a JSON object (got {type(raw).__name__}).")
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}.")
    enabled = _bool(raw, "enable_kv_cache_events", False)
    publisher = raw.get("publisher")
    if publisher is None:
        publisher = "zmq" if enabled else "null"
    if publisher not in PUBLISHERS:
        raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)} (got {publisher!r}).")
    endpoint = _endpoint(raw, "endpoint", "tcp://*:5557")
    replay = _endpoint(raw, "replay_endpoint", None)
    topic = raw.get("topic", "")
    if not isinstance(topic, str):
        raise ValueError(f"kv_events_config.topic must be text (got {topic!r}).")
    cfg = KVEventsConfig(
        enable_kv_cache_events=enabled, publisher=publisher, endpoint=endpoint or "", replay_endpoint=replay,
        buffer_steps=_int(raw, "buffer_steps", 10_000, 1), hwm=_int(raw, "hwm", 100_000, 0),
        max_queue_size=_int(raw, "max_queue_size", 100_000, 1), topic=topic,
    )
    if cfg.publishes and replay is not None and replay == endpoint and not endpoint.endswith(":0"):
        raise ValueError("kv_events_config.replay_endpoint must differ from endpoint (two sockets cannot share it).")
    return cfg


def _bool(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"kv_events_config.{key} must be true or false (got {value!r}).")
    return value


def _int(raw: dict[str, Any], key: str, default: int, minimum: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= 2**31 - 1:
        raise ValueError(f"kv_events_config.{key} must be an integer >= {minimum} and <= {2**31 - 1} (got {value!r}).")
    return value


def _endpoint(raw: dict[str, Any], key: str, default: str | None) -> str | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(_SCHEMES):
        raise ValueError(f"kv_events_config.{key} must be a ZMQ address starting {', '.join(_SCHEMES)} "
                         f"such as tcp://*:5557 (got {value!r}).")
    if value.startswith("tcp://"):
        host, sep, port = value[len("tcp://"):].rpartition(":")
        lowest = 0 if binds(value) else 1  # a bound port 0: one the system picks
        if not sep or not host or not port.isdigit() or not lowest <= int(port) < 65536:
            raise ValueError(f"kv_events_config.{key} must be tcp://HOST:PORT with a port in {lowest}..65535 "
                             f"(got {value!r}).")
    return value


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, ``ipc://`` or ``inproc://`` is bound; any other is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
