"""The prefill backlog and the measured prefill rate: what the autoscaler's TTFT signal reads.

The backlog is the tokens still to be prefilled: the whole prompts of waiting requests (a
preempted request's recompute, outputs included, counts too; a prefix-cache hit is known only
at admission, where it leaves the backlog) and the unfinished rest of running prompts. The
rate is the backlog's drain rate: prompt tokens computed per second of wall time while there
was a backlog (from the arrival that started it to the step that emptied it; idle time
between bursts does not dilute it, and a backlog the engine cannot work on, with every slot
or block taken, lowers it), as decayed sums of tokens and seconds with a half-life of
``RATE_HALF_LIFE_S`` of such time. Wall time, not the step's own duration: under async
scheduling a step call returns before its forward pass ends. Backlog / rate is the seconds a
new request waits before its prompt starts to compute.

Kept without a loop over the queues per step: a running total of the waiting requests'
tokens, updated when requests are added, admitted, preempted or removed, and a small table of
the running requests still mid-prompt (those admitted in the last steps, or chunked), checked
once per step. Imports no torch; knows nothing about the scheduler's policy.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

from inflight.runtime.core.request import Request

RATE_HALF_LIFE_S = 5.0  # backlogged seconds over which a sample's weight halves


class PrefillBacklog:
    """See module docstring. The engine calls each hook at the event it names."""

    def __init__(self) -> None:
        self._waiting: dict[Request, int] = {}  # waiting request -> the tokens it will prefill
        self._waiting_tokens = 0
        self._prefilling: dict[Request, int] = {}  # running, mid-prompt -> computed tokens counted
        self.num_computed_tokens = 0  # cumulative prefill tokens computed (cache hits excluded)
        self._counted_at_step = 0  # num_computed_tokens when the last step ended
        self._busy_since: float | None = None  # start of the interval being measured; None: no backlog
        self._tokens = 0.0  # decayed sums: prefill tokens computed, and the backlogged seconds
        self._seconds = 0.0

    @property
    def tokens_per_second(self) -> float:
        """The measured drain rate; 0.0 until a backlog was worked on (no rate, not infinity)."""
        return self._tokens / self._seconds if self._seconds > 0.0 and self._tokens > 0.0 else 0.0

    @property
    def num_backlog_tokens(self) -> int:
        return self._waiting_tokens + sum(max(0, r.num_tokens - r.num_computed_tokens) for r in self._prefilling)

    def added(self, req: Request) -> None:
        """``req`` joined the waiting queue (new, or preempted: its computed tokens are gone)."""
        if self._busy_since is None or self.num_backlog_tokens == 0:  # a backlog starts: measure from now
            self._busy_since = time.monotonic()
        self._credit(req)
        self._prefilling.pop(req, None)
        old = self._waiting.get(req, 0)
        self._waiting[req] = req.num_tokens
        self._waiting_tokens += req.num_tokens - old

    def admitted(self, req: Request) -> None:
        """``req`` left the waiting queue for the running batch (prefix-cache hits computed)."""
        self._waiting_tokens -= self._waiting.pop(req, 0)
        if req.num_tokens - req.num_computed_tokens > 1:
            self._prefilling[req] = req.num_computed_tokens

    def remover(self, then: Callable[[Request], None]) -> Callable[[Request], None]:
        """The hook for a request that finished or was aborted: out of the backlog, then ``then``
        (the scheduler's remove). A closure over this object, not the engine, so the engine and
        its output processor hold no cycle and a closed engine frees its runner by reference
        counting alone (tests/runtime/test_runner_release.py)."""
        def remove(req: Request) -> None:
            self.removed(req)
            then(req)
        return remove

    def scheduled(self, preempted: Iterable[Request], admitted: Iterable[Request]) -> None:
        """A schedule preempted these requests (back to waiting, to be computed again) and admitted those."""
        for req in preempted:
            self.added(req)
        for req in admitted:
            self.admitted(req)

    def removed(self, req: Request) -> None:
        """``req`` finished or was aborted, from whichever queue."""
        self._waiting_tokens -= self._waiting.pop(req, 0)
        self._credit(req)
        self._prefilling.pop(req, None)

    def stepped(self, now: float) -> None:
        """A step ended at ``now`` (time.monotonic): count the prompt tokens it computed, update
        the rate, and forget the requests whose prompt is done."""
        for req in list(self._prefilling):
            self._credit(req)
            if req.num_tokens - req.num_computed_tokens <= 1:
                del self._prefilling[req]
        # Prompts that finished inside the step (max_tokens=1) were counted when removed.
        if self._busy_since is not None:
            self._observe(self.num_computed_tokens - self._counted_at_step, now - self._busy_since)
        self._counted_at_step = self.num_computed_tokens
        self._busy_since = now if self.num_backlog_tokens > 0 else None

    def reset_counts(self) -> None:
        """Forget the computed tokens and the rate (after the warm-up)."""
        self.num_computed_tokens = self._counted_at_step = 0
        self._tokens = self._seconds = 0.0
        self._busy_since = None

    def _credit(self, req: Request) -> None:
        """Count what ``req`` computed of its prompt since it was last counted (a step that
        failed and rolled back is counted once, when it is computed again)."""
        counted = self._prefilling.get(req)
        if counted is not None and req.num_computed_tokens > counted:
            self.num_computed_tokens += req.num_computed_tokens - counted
            self._prefilling[req] = req.num_computed_tokens

    def _observe(self, num_tokens: int, seconds: float) -> None:
        if seconds <= 0.0:
            return
        decay = math.exp(-seconds * math.log(2) / RATE_HALF_LIFE_S)
        self._tokens = self._tokens * decay + num_tokens
        self._seconds = self._seconds * decay + seconds
