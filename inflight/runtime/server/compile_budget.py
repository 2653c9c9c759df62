"""Each client's allowance of grammar compile work, so one client cannot keep the compilers busy.

A structured-output constraint is compiled once (then cached) on a small worker pool, and a
compile may take up to the compile deadline (5 s). A client that sends a stream of distinct,
expensive schemas would hold every worker and make other clients' constraints queue or time
out. So each client (its API key when it sends one, else its peer address) has:

* at most :data:`MAX_IN_FLIGHT` compiles under way at a time, and
* a bucket of compile seconds: :data:`BURST_S` at most, refilled at :data:`REFILL_PER_S`
  seconds per second. A compile costs the seconds from its submission to its verdict (a cache
  hit costs nothing); a client whose bucket is empty is refused until it refills.

A refusal is a 429 ``rate_limit_error`` / ``compile_budget`` with ``Retry-After``; the request
is not queued. Behind a proxy that hides peer addresses, keyless clients share one budget.
At most :data:`MAX_CLIENTS` clients are tracked (the least recently seen are forgotten).
Knows nothing about grammars beyond the future a compile returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from inflight.runtime.server.errors import APIError

MAX_IN_FLIGHT = 2
BURST_S = 20.0  # four compiles at the deadline
REFILL_PER_S = 0.5  # a client may keep half a core compiling, on average
MAX_CLIENTS = 4096


@dataclass(slots=True)
class _Allowance:
    seconds: float
    updated: float
    in_flight: int = 0


class CompileBudget:
    """Per-client compile allowance (see module docstring); used on the event loop only."""

    def __init__(self, burst_s: float = BURST_S, refill_per_s: float = REFILL_PER_S,
                 max_in_flight: int = MAX_IN_FLIGHT, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.burst_s = burst_s
        self.refill_per_s = refill_per_s
        self.max_in_flight = max_in_flight
        self.max_clients = max_clients
        self._clients: OrderedDict[str, _Allowance] = OrderedDict()
        self.num_refused = 0

    async def compile(self, client: str, submit: Callable[[], concurrent.futures.Future[Any]],
                      known: Callable[[], bool]) -> Any:
        """``submit()`` -> a ``concurrent.futures.Future`` of the compile; its result, charged
        to ``client``. ``known()``: the compile would answer at once (cached), which is free.
        Raises the 429 :class:`APIError`, before submitting, when the client is over its allowance."""
        if known():
            return await asyncio.wrap_future(submit())
        allowance = self._admit(client)
        allowance.in_flight += 1
        started = self._clock()
        try:
            return await asyncio.wrap_future(submit())
        finally:
            allowance.in_flight -= 1
            allowance.seconds -= self._clock() - started

    def _admit(self, client: str) -> _Allowance:
        now = self._clock()
        allowance = self._clients.pop(client, None) or _Allowance(self.burst_s, now)
        self._clients[client] = allowance  # most recently seen last
        while len(self._clients) > self.max_clients:
            oldest, forgotten = next(iter(self._clients.items()))
            if forgotten.in_flight:
                break
            del self._clients[oldest]
        allowance.seconds = min(self.burst_s, allowance.seconds + (now - allowance.updated) * self.refill_per_s)
        allowance.updated = now
        if allowance.in_flight >= self.max_in_flight:
            self._refuse(f"this client already has {allowance.in_flight} structured-output constraints "
                         "compiling, the most one client may have at a time; wait for them", 1.0)
        if allowance.seconds <= 0:
            wait = -allowance.seconds / self.refill_per_s + 1.0
            self._refuse("this client has used its allowance of structured-output compile time "
                         f"({self.burst_s:g} s, refilled at {self.refill_per_s:g} s per second); "
                         "reuse constraints (compiled ones are cached) or retry later", wait)
        return allowance

    def _refuse(self, message: str, retry_after_s: float) -> None:
        self.num_refused += 1
        raise APIError(429, message, "rate_limit_error", code="compile_budget",
                       headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def client_key(request: web.Request) -> str:
    """Who pays for a compile: a digest of the bearer token if one is sent, else the peer address."""
    auth = request.headers.get("Authorization", "")
    if auth:
        return "key:" + hashlib.sha256(auth.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return f"addr:{request.remote or '?'}"
