"""Each caller's allowance of grammar compile work, and fair turns at the compilers.

A structured-output constraint is compiled once (then cached) on a small worker pool, and a
compile may take up to the compile deadline (5 s). A caller that sends a stream of distinct,
expensive schemas would hold every worker and make other callers' constraints queue or time
out. So each caller, its *principal* (:func:`~inflight.runtime.server.principal.principal`:
the API key it authenticated with, however the ``Authorization`` header spells it, or its peer
address on a server without keys), has:

* at most :data:`MAX_IN_FLIGHT` compiles waiting or under way at a time, and
* a bucket of compile seconds: :data:`BURST_S` at most, refilled at :data:`REFILL_PER_S`
  seconds per second. A compile costs the seconds from its start on a worker to its verdict
  (a cache hit, and the time spent waiting for a turn, cost nothing); a caller whose bucket is
  empty is refused until it refills.

At most :data:`MAX_RUNNING` compiles (the compile pool's workers) are handed to the pool at a
time; a freed slot goes to the waiting principal with the fewest compiles under way, the
first in a round-robin order among equals. So one principal's backlog never puts another's
compile behind all of it: a newcomer with nothing running goes next. At most
:data:`MAX_WAITING` compiles wait in all. (A compile past the deadline gives its slot back when
its request is refused; llguidance cannot be stopped, so its worker finishes it meanwhile.)

A refusal is a 429 ``rate_limit_error`` / ``compile_budget`` with ``Retry-After``. Holders of
one shared key are one principal and share one allowance. At most :data:`MAX_CLIENTS`
principals are tracked (the least recently seen are forgotten). Knows nothing about grammars
beyond the future a compile returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inflight.runtime.server.errors import APIError

MAX_IN_FLIGHT = 2  # per principal: compiles waiting or under way
MAX_RUNNING = 2  # in all: compiles handed to the pool (StructuredOutputManager's DEFAULT_NUM_WORKERS)
MAX_WAITING = 64  # in all: compiles waiting for a turn
BURST_S = 20.0  # four compiles at the deadline
REFILL_PER_S = 0.5  # a principal may keep half a core compiling, on average
MAX_CLIENTS = 4096


@dataclass(slots=True)
class _Allowance:
    seconds: float
    updated: float
    in_flight: int = 0


class CompileBudget:
    """Per-principal compile allowance and fair turns (see the module docstring); used on the
    event loop only. ``max_running``: compiles handed to the pool at once; ``max_waiting``:
    compiles that may wait for a turn."""

    def __init__(self, burst_s: float = BURST_S, refill_per_s: float = REFILL_PER_S,
                 max_in_flight: int = MAX_IN_FLIGHT, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic, *, max_running: int = MAX_RUNNING,
                 max_waiting: int = MAX_WAITING) -> None:
        if min(max_in_flight, max_running, max_clients) < 1 or max_waiting < 0:
            raise ValueError("max_in_flight, max_running and max_clients must be >= 1 and max_waiting >= 0.")
        self._clock = clock
        self.burst_s = burst_s
        self.refill_per_s = refill_per_s
        self.max_in_flight = max_in_flight
        self.max_clients = max_clients
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._clients: OrderedDict[str, _Allowance] = OrderedDict()
        # Principals with compiles waiting for a turn, in turn order; each one's waiters oldest first.
        self._turns: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._running: dict[str, int] = {}  # compiles under way, per principal that has any
        self.num_running = 0
        self.num_waiting = 0
        self.num_refused = 0

    async def compile(self, client: str, submit: Callable[[], concurrent.futures.Future[Any]],
                      known: Callable[[], bool]) -> Any:
        """``submit()`` -> a ``concurrent.futures.Future`` of the compile; its result, charged
        to ``client`` (a principal). ``known()``: the compile would answer at once (cached),
        which is free and takes no turn. Raises the 429 :class:`APIError`, before submitting,
        when the client is over its allowance or too many compiles wait."""
        if known():
            return await asyncio.wrap_future(submit())
        allowance = self._admit(client)
        allowance.in_flight += 1
        try:
            await self._take_turn(client)
            started = self._clock()
            try:
                return await asyncio.wrap_future(submit())
            finally:
                allowance.seconds -= self._clock() - started
                self._pass_turn(client)
        finally:
            allowance.in_flight -= 1

    async def _take_turn(self, client: str) -> None:
        """Return holding one of the ``max_running`` slots: at once when one is free and
        nobody waits, else when :meth:`_pass_turn` hands this client one."""
        if self.num_running < self.max_running and not self._turns:
            self.num_running += 1
            self._running[client] = self._running.get(client, 0) + 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._turns.setdefault(client, deque()).append(turn)
        self.num_waiting += 1
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._pass_turn(client)  # handed a slot just as the client went away: pass it on
            else:
                self._forget(client, turn)
            raise

    def _pass_turn(self, releasing: str) -> None:
        """``releasing`` gives its slot back: to the waiting principal with the fewest compiles
        running (``releasing``'s own still counted, so it yields to one with none), the first
        in turn order among equals, which then goes to the back of the order (round-robin)."""
        handed = self._next_turn()
        count = self._running.pop(releasing) - 1
        if count:
            self._running[releasing] = count
        if handed is None:
            self.num_running -= 1
            return
        client, turn = handed
        self._running[client] = self._running.get(client, 0) + 1
        turn.set_result(None)

    def _next_turn(self) -> tuple[str, asyncio.Future[None]] | None:
        """Take the next waiting compile off the turns (skipping ones whose client left)."""
        while self._turns:
            client = min(self._turns, key=lambda c: self._running.get(c, 0))  # the first of the fewest
            waiters = self._turns[client]
            turn = waiters.popleft()
            self.num_waiting -= 1
            if waiters:
                self._turns.move_to_end(client)
            else:
                del self._turns[client]
            if not turn.done():
                return client, turn
        return None

    def _forget(self, client: str, turn: asyncio.Future[None]) -> None:
        waiters = self._turns.get(client)
        if waiters is not None and turn in waiters:
            waiters.remove(turn)
            self.num_waiting -= 1
            if not waiters:
                del self._turns[client]

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
        if self.num_running >= self.max_running and self.num_waiting >= self.max_waiting:
            self._refuse(f"{self.num_waiting} structured-output constraints are already waiting to compile, "
                         "the most this server queues; retry shortly", 1.0)
        return allowance

    def _refuse(self, message: str, retry_after_s: float) -> None:
        self.num_refused += 1
        raise APIError(429, message, "rate_limit_error", code="compile_budget",
                       headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})
