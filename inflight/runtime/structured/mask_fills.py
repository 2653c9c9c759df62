"""Grammar token masks filled on worker threads, so one grammar's cost stays its own.

A :class:`MaskFill` computes one matcher's allowed tokens for its next position on a worker
thread (llguidance drops the GIL) while the step's forward pass runs. The sampler waits a
short grace for the fills of grammars that have been quick; a fill still running after it is
*late*: the step goes on without that row (the engine parks the request until the fill is
done, and recomputes its last position then), the grammar is marked slow, and the late
fill's thread is dropped to the lowest CPU priority. A slow grammar's later fills are never
waited for and run on at most :data:`SLOW_WORKERS` lowest-priority threads, so an expensive
grammar spends CPU the forward pass does not want instead of other requests' time. It turns
quick again after a fill that costs less than the grace.

A slow grammar's advance past its sampled token runs in its next fill too (``pending_token``):
for an ambiguous grammar it costs as much as a mask. Its outcome (refused, or the grammar is
complete) then ends the request between steps instead of in the step that sampled it.

A fill's cost is the CPU time of its thread (an injected ``slow-mask`` stall counts as cost,
tests only), so the per-mask deadline measures work, not time spent queued or starved; the
engine ends a request whose fill costs more than :data:`MASK_DEADLINE_S`.

Priorities use Linux's per-thread nice values; elsewhere they are not applied (logged once).
A thread that was lowered retires after its fill, since an unprivileged process cannot raise
a thread's priority back. Knows nothing about requests beyond their matchers.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import llguidance.numpy as llnp
import numpy as np

from inflight.runtime.structured.faults import STALL_CAP_S
from inflight.runtime.structured.manager import RequestMatcher

logger = logging.getLogger("inflight.structured")

# The most one token mask of one request may cost (CPU seconds of its fill). A mask normally
# costs microseconds to a few milliseconds; an ambiguous grammar can cost seconds per token
# (issue 19: ~2 s on a 49k vocabulary). Past this the request ends with an error.
MASK_DEADLINE_S = 0.5
# How long a step waits for a quick grammar's mask once its forward pass is done: a fraction
# of the forward pass's time, within these bounds. Later than that the row is parked.
GRACE_FRACTION = 0.25
MIN_GRACE_S = 0.002
MAX_GRACE_S = 0.05
QUICK_AGAIN_S = MIN_GRACE_S  # a slow grammar whose fill costs less than this is quick again
QUICK_WORKERS = 64  # threads start on demand; quick fills take microseconds
SLOW_WORKERS = max(1, (os.cpu_count() or 2) // 2)
LOWEST_PRIORITY = 19  # nice value of a slow grammar's fill threads


def grace_s(forward_s: float) -> float:
    """How long to wait for quick fills after a forward pass of ``forward_s`` seconds."""
    return min(MAX_GRACE_S, max(MIN_GRACE_S, GRACE_FRACTION * forward_s))


class MaskFill:
    """One matcher's token mask for its next position, filled by a worker thread."""

    __slots__ = ("matcher", "bitmask", "future", "outcome", "_thread", "_cpu_start", "_stall_start", "_cost", "_lock")

    def __init__(self, matcher: RequestMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.outcome = "ok"  # or, after consuming a pending token: "refused", "stopped" (no mask then)
        self.bitmask: np.ndarray = llnp.allocate_token_bitmask(1, vocab_size)
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread: _Worker | None = None
        self._cpu_start = 0.0
        self._stall_start: float | None = None
        self._cost: float | None = None
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self.future.done()

    def cost_s(self) -> float:
        """CPU seconds spent on this fill so far (0 while queued)."""
        with self._lock:
            if self._cost is not None:
                return self._cost
            if self._thread is None:
                return 0.0
            stalled = time.monotonic() - self._stall_start if self._stall_start is not None else 0.0
            return self._thread.cpu_time() - self._cpu_start + stalled

    def lower_priority(self) -> None:
        """Drop the running fill's thread to the lowest priority (it retires afterwards)."""
        with self._lock:
            if self._thread is not None and self._cost is None:
                self._thread.lower()

    def run(self, worker: _Worker) -> None:
        """On ``worker``: fill the mask, record its cost, settle ``future``."""
        if not self.future.set_running_or_notify_cancel():
            return
        with self._lock:
            self._thread, self._cpu_start = worker, worker.cpu_time()
        try:
            if self.matcher.stall is not None:  # an injected slow-mask fault (tests only)
                self._stall_start = time.monotonic()
                self.matcher.stall.wait(STALL_CAP_S)
            self._advance()
            if self.outcome == "ok":
                llnp.fill_next_token_bitmask(self.matcher.matcher, self.bitmask, 0)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever reads the fill
            self._settle(worker)
            self.future.set_exception(exc)
            return
        self._settle(worker)
        self.future.set_result(None)

    def _advance(self) -> None:
        """Consume the slow grammar's pending token first (the fill's mask is for the position after it)."""
        token_id, self.matcher.pending_token = self.matcher.pending_token, None
        if token_id is None:
            return
        if not self.matcher.accept(token_id):
            self.outcome = "refused"
        elif self.matcher.is_finished:
            self.outcome = "stopped"

    def _settle(self, worker: _Worker) -> None:
        with self._lock:
            stalled = time.monotonic() - self._stall_start if self._stall_start is not None else 0.0
            self._cost = worker.cpu_time() - self._cpu_start + stalled


class MaskFiller:
    """Starts fills on the quick or the slow workers and keeps each matcher's pending one."""

    def __init__(self) -> None:
        self._quick = _Workers("inflight-masks", QUICK_WORKERS, lowest=False)
        self._slow = _Workers("inflight-slow-masks", SLOW_WORKERS, lowest=True)

    def fill(self, matcher: RequestMatcher, vocab_size: int) -> MaskFill:
        """``matcher``'s fill for its next position: the pending one, or a new one."""
        pending = matcher.fill
        if isinstance(pending, MaskFill):
            return pending
        fill = MaskFill(matcher, vocab_size)
        matcher.fill = fill
        (self._slow if matcher.slow else self._quick).submit(fill.run)
        return fill

    @staticmethod
    def consume(fill: MaskFill) -> None:
        """The mask was applied: the next fill is for the next position. A fill that cost
        less than ``QUICK_AGAIN_S`` makes its grammar quick again."""
        fill.matcher.fill = None
        if fill.matcher.slow and fill.cost_s() < QUICK_AGAIN_S:
            fill.matcher.slow = False

    @staticmethod
    def late(fill: MaskFill) -> None:
        """``fill`` missed its step: its grammar is slow from now on, its thread lowest priority."""
        if not fill.matcher.slow:
            fill.matcher.slow = True
            fill.lower_priority()

    def kick(self) -> None:
        """Replace retired threads while fills wait (the engine calls this every step)."""
        self._quick.kick()
        self._slow.kick()

    def close(self) -> None:
        self._quick.close()
        self._slow.close()


class _Worker:
    """One fill thread: its CPU clock and its priority."""

    _warned = False

    def __init__(self) -> None:
        self.ident = threading.get_ident()
        self.native_id = threading.get_native_id()
        self.lowered = False

    def cpu_time(self) -> float:
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self.ident))
        except (OSError, AttributeError):  # the thread is gone, or no per-thread clocks here
            return time.thread_time() if threading.get_ident() == self.ident else 0.0

    def lower(self) -> None:
        if self.lowered:
            return
        self.lowered = True
        try:
            os.setpriority(os.PRIO_PROCESS, self.native_id, LOWEST_PRIORITY)  # Linux: this thread only
        except (OSError, AttributeError) as exc:
            if not _Worker._warned:
                _Worker._warned = True
                logger.warning("cannot lower a grammar mask thread's CPU priority here (%s); slow grammars "
                               "still leave the step but compete for CPU at normal priority", exc)


class _Workers:
    """A small thread pool whose threads start on demand and retire once lowered."""

    def __init__(self, name: str, max_workers: int, lowest: bool) -> None:
        self._name = name
        self._max = max_workers
        self._lowest = lowest
        self._tasks: queue.SimpleQueue[Callable[[_Worker], Any] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, task: Callable[[_Worker], Any]) -> None:
        self._tasks.put(task)
        self.kick()

    def kick(self) -> None:
        """Start a thread if tasks wait and none is idle (call from a normal-priority thread:
        a new thread inherits its creator's priority)."""
        with self._lock:
            if self._tasks.empty() or self._idle > 0 or self._threads >= self._max:
                return
            self._threads += 1
        threading.Thread(target=self._loop, name=f"{self._name}-{self._threads}", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            threads = self._threads
        for _ in range(threads):
            self._tasks.put(None)

    def _loop(self) -> None:
        worker = _Worker()
        if self._lowest:
            worker.lower()
        while True:
            with self._lock:
                self._idle += 1
            task = self._tasks.get()
            with self._lock:
                self._idle -= 1
            if task is None:
                break
            task(worker)
            if worker.lowered and not self._lowest:
                break  # lowered for a late fill: retire, a new thread starts at normal priority
        with self._lock:
            self._threads -= 1
