"""The engine watchdog's judgement: when a running engine counts as stalled.

The server's watchdog task (:mod:`.app`) consults one :class:`StallWatch` per tick (every
``interval_s``). Two rules, one limit (``--engine-stall-timeout``):

* a step in progress that started more than the limit ago (the step clock the engine
  publishes: a step that never returns);
* no step in progress, and the engine's loop has answered none of its heartbeats for as many
  ticks as make up the limit (a loop that no longer turns: an engine-core process frozen while
  idle by SIGSTOP or a debugger, a hang between steps). Ticks are counted, not seconds: a
  front end whose own event loop was held for a while comes back to one missed tick, never to
  a verdict on time it could not watch.

Each tick sends the next heartbeat (``ping``) once the last one was answered. Knows nothing
about HTTP, processes or threads: the engine client says how a heartbeat travels.
"""

from __future__ import annotations

import math
from typing import Protocol

MAX_TICK_S = 1.0
MIN_TICKS = 4  # ticks in one stall timeout, at the least


class Watched(Protocol):
    """What the watchdog reads of the engine client (:class:`~.engine_client.EngineClient`)."""

    heartbeat: int

    @property
    def is_ready(self) -> bool: ...

    @property
    def step_started_at(self) -> float | None: ...

    def ping(self) -> None: ...


class StallWatch:
    """The stall verdict, one tick at a time (see the module docstring)."""

    def __init__(self, limit_s: float) -> None:
        if not limit_s > 0:
            raise ValueError(f"the engine stall timeout must be > 0 seconds (got {limit_s}).")
        self.limit_s = limit_s
        self.interval_s = min(MAX_TICK_S, limit_s / MIN_TICKS)
        self.max_missed = math.ceil(limit_s / self.interval_s)  # ticks without an answer
        self.missed = 0
        self._last_heartbeat: int | None = None

    def tick(self, engine: Watched, now: float) -> str | None:
        """Judge the engine at ``now`` (``time.monotonic()``): why it is dead, or None."""
        started = engine.step_started_at
        if started is not None:  # a step runs: the step clock judges, the heartbeat waits for it
            self.missed = 0
            if now - started > self.limit_s:
                return f"an engine step has not returned within the stall timeout ({self.limit_s:g} s)"
        elif engine.is_ready:
            heartbeat = engine.heartbeat
            self.missed = 0 if heartbeat != self._last_heartbeat else self.missed + 1
            self._last_heartbeat = heartbeat
            if self.missed >= self.max_missed:
                return (f"the engine answered no heartbeat within the stall timeout ({self.limit_s:g} s) "
                        "with no step running: its loop is frozen (a stopped or hung engine core)")
        if engine.is_ready:
            engine.ping()
        return None
