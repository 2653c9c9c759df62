"""Test-only fault injection for the engine's step loop: a death, a stall or slow steps on demand.

The step loop (:class:`inflight.runtime.engine_core.core.EngineCore`, in the engine-core
process or on a thread with ``--single-process``) reads the variable when it starts.
``INFLIGHT_TEST_ENGINE_FAULT=die-after-steps:N`` makes the loop die of a
``BaseException`` (not an ``Exception``, like ``SystemExit``) before step N+1;
``stall-after-steps:N`` makes step N+1 never return; ``slow-steps:MS`` makes every step
sleep MS milliseconds before it runs. The supervision tests use the first two to check
that the server turns ``/health`` to 503, answers every client and exits non-zero; tests
that need work to stay in flight for a while (a timeout that must fire, a probe that must
be answered while the engine is busy) use the third instead of assuming the engine is slow.
Never set it in production. Knows nothing about the engine or HTTP; it sits beside the engine,
not in ``server/``, so the engine-core process reads it without importing the server.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("inflight.server.engine")

FAULT_ENV = "INFLIGHT_TEST_ENGINE_FAULT"
FAULT_FORMS = "die-after-steps:N, stall-after-steps:N or slow-steps:MS"


class Fault:
    """A test-only injected failure of the engine thread (see ``FAULT_ENV``).

    ``kind`` is ``die``, ``stall`` or ``slow``; ``count`` is the number of healthy steps
    before a death or stall, or the milliseconds every step sleeps when ``slow``."""

    def __init__(self, kind: str, count: int) -> None:
        self.kind = kind
        self.steps_left = count
        self.step_sleep_s = count / 1000.0

    def before_step(self) -> None:
        if self.kind == "slow":
            time.sleep(self.step_sleep_s)
            return
        if self.steps_left > 0:
            self.steps_left -= 1
            return
        if self.kind == "die":
            raise InjectedDeath(f"{FAULT_ENV}: injected engine-thread death")
        logger.warning("%s: stalling the engine thread", FAULT_ENV)
        threading.Event().wait()  # never returns


class InjectedDeath(BaseException):
    """Not an ``Exception``: like a ``SystemExit`` or ``KeyboardInterrupt`` in the thread."""


def parse_fault(spec: str) -> Fault | None:
    """The fault ``spec`` names, None for an empty one; ValueError for anything else."""
    if not spec:
        return None
    kind, sep, count = spec.partition("-after-steps:")
    if sep and kind in ("die", "stall") and count.isdigit():
        fault = Fault(kind, int(count))
    elif spec.startswith("slow-steps:") and spec.removeprefix("slow-steps:").isdigit():
        fault = Fault("slow", int(spec.removeprefix("slow-steps:")))
    else:
        raise ValueError(f"{FAULT_ENV} must be {FAULT_FORMS} (got {spec!r})")
    logger.warning("%s=%s: fault injection is on (tests only)", FAULT_ENV, spec)
    return fault
