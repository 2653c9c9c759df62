"""Linux process settings for the server's own processes: a name ps and top show, and death with the parent.

The engine core (:mod:`.core`) and every extra front end (:mod:`inflight.runtime.server.front_ends`)
call these at start: each is named (``inflight-core``, ``inflight-api-N``), and each asks the kernel
for SIGKILL when the process that started it dies, however it dies, so no orphan is left holding a
GPU. Both go through prctl(2); elsewhere they do nothing (naming) or log that they could not.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys

logger = logging.getLogger("inflight.engine_core")
PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # prctl(2) options


def _prctl(option: int, value: object) -> bool:
    """Linux's prctl(2) through libc; False where there is none (not Linux, no libc symbol)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, value)
    except (OSError, AttributeError):
        return False
    return True


def name_process(name: bytes) -> None:
    """Linux: name the process (and the threads it starts, which inherit the name) so that ps,
    top and the bench's process report tell it from the front end(s); best effort."""
    _prctl(PR_SET_NAME, ctypes.c_char_p(name))


def die_with_parent() -> None:
    """Linux: get SIGKILL when the parent (the core's: front end 0) dies, however it dies (no orphan)."""
    if sys.platform.startswith("linux") and not _prctl(PR_SET_PDEATHSIG, signal.SIGKILL):
        logger.warning("could not ask to die with the front end (prctl); an orphan would exit at its next pipe read")
