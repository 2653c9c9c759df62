"""The activator's time: ``now()`` and ``sleep()``, injected so tests move time by hand.

Owns ``Clock`` (the protocol), ``MonotonicClock`` (production) and ``ManualClock`` (tests: time
moves only on ``advance``, and sleepers wake then). Knows nothing about HTTP or backends.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class MonotonicClock:
    """``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class ManualClock:
    """A clock that moves only when told: ``advance(s)`` wakes every sleeper whose time came."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._moved = asyncio.Condition()

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        until = self._now + seconds
        async with self._moved:
            await self._moved.wait_for(lambda: self._now >= until)

    async def advance(self, seconds: float) -> None:
        """Move time on and let the woken sleepers run until they block again."""
        async with self._moved:
            self._now += seconds
            self._moved.notify_all()
        for _ in range(5):  # the woken tasks, and what they start, get to run
            await asyncio.sleep(0)
