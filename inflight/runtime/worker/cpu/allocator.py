"""glibc's malloc told to keep the memory a CPU step frees, for the next step to reuse.

A prompt step of a few thousand tokens allocates activations of megabytes each (bench-medium
at 2048 tokens: 4 MB hidden states, 8 MB q/k/v, 25 MB gate/up). glibc serves a block above its
mmap threshold (128 KiB at start, raised as such blocks are freed, up to 32 MiB) with a fresh
``mmap`` and gives it back to the kernel when it is freed, and trims the heap's top above 128
KiB too, so the next step faults every page in again, zero-filled: 55-87 thousand minor page
faults per 2048-token step of bench-medium on the 2-core AMD EPYC (20-65 thousand after a
warm-up), against 1-23 with the settings below, which took those steps 2465 -> 2260 ms (median
of 8 each, two interleaved pairs of engines: ~8%). Decode steps allocate little and fault
nothing either way.

:func:`keep_freed_memory` sets ``M_MMAP_THRESHOLD`` to glibc's ceiling (32 MiB: smaller blocks
come from the heap), ``M_TRIM_THRESHOLD`` to 1 GiB and ``M_TOP_PAD`` to 64 MiB, so freed
blocks stay in the heap. vLLM gets the same from preloading tcmalloc; this needs no library
and no ``LD_PRELOAD``. The cost: the process keeps its largest step's activations resident
(tens of MB for the bench models, what the step needed anyway). Nothing happens off glibc, or
with ``INFLIGHT_CPU_MALLOC_TUNING=0``. Knows nothing about models or steps.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from functools import lru_cache

from inflight import env_vars

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))


@lru_cache(maxsize=1)
def keep_freed_memory() -> str:
    """Apply :data:`SETTINGS` once per process; what was done, for the log."""
    if (env_vars.read_int("INFLIGHT_CPU_MALLOC_TUNING") or 0) == 0:
        return "malloc untuned (INFLIGHT_CPU_MALLOC_TUNING=0)"
    if platform.libc_ver()[0] != "glibc":
        return "malloc untuned (not glibc)"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "malloc untuned (no mallopt)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    refused = [param for param, value in SETTINGS if mallopt(param, value) != 1]
    if refused:
        logger.warning("glibc refused mallopt parameter(s) %s", refused)
        return f"malloc partly tuned (refused: {refused})"
    return "malloc keeps freed memory (mmap threshold 32 MiB, trim threshold 1 GiB)"
