"""Test-only fault injection for the engine's step loop: a death or a stall on demand.

The step loop is the engine thread of ``async_engine`` (``--single-process``) or the
engine-core process (:mod:`inflight.runtime.engine_core.core`); both read the variable.
``INFLIGHT_TEST_ENGINE_FAULT=die-after-steps:N`` makes the loop die of a
``BaseException`` (not an ``Exception``, like ``SystemExit``) before step N+1;
``stall-after-steps:N`` makes step N+1 never return. The supervision tests use them to
check that the server turns ``/health`` to 503, answers every client and exits non-zero.
Never set it in production. Knows nothing about the engine or HTTP.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("inflight.server.engine")

FAULT_ENV = "INFLIGHT_TEST_ENGINE_FAULT"


class Fault:
    """A test-only injected failure of the engine thread (see ``FAULT_ENV``)."""

    def __init__(self, kind: str, after_steps: int) -> None:
        self.kind = kind
        self.steps_left = after_steps

    def before_step(self) -> None:
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
    if not spec:
        return None
    kind, _, count = spec.partition("-after-steps:")
    if kind not in ("die", "stall") or not count.isdigit():
        raise ValueError(f"{FAULT_ENV} must be die-after-steps:N or stall-after-steps:N (got {spec!r})")
    logger.warning("%s=%s: fault injection is on (tests only)", FAULT_ENV, spec)
    return Fault(kind, int(count))
