"""glibc's malloc keeps what a step frees (inflight.runtime.worker.cpu.allocator): a step-sized block
comes from the heap rather than its own mmap, and once freed it stays in the heap (no trim),
where the next step's allocations reuse it without faulting pages in; the switch turns it off.
Each case runs in a fresh process: the settings are process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = """
import ctypes, json, resource, sys, torch
from inflight.runtime.worker.cpu.allocator import keep_freed_memory
said = keep_freed_memory()
class Info(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
before = libc.mallinfo2()
live = [torch.empty(n << 20).fill_(1.0) for n in (2, 6, 4, 6, 3, 2, 4)]  # a step's activations: 8-24 MiB
during = libc.mallinfo2()
del live
after = libc.mallinfo2()
start = faults()
again = [torch.empty(n << 20).fill_(1.0) for n in (2, 6, 4, 6, 3, 2, 4)]  # the next step
print(json.dumps({"said": said, "mmapped": during.hblkhd - before.hblkhd, "kept_free": after.fordblks,
                  "faults": faults() - start}))
"""
STEP_BYTES = 27 << 22  # the probe's blocks: 108 MiB


def _probe(tuning: str) -> dict:
    env = {**os.environ, "INFLIGHT_CPU_MALLOC_TUNING": tuning}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                          check=True)  # fmt: skip
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or platform.libc_ver()[1] < "2.33",
                    reason="tunes glibc's malloc only (mallinfo2 from 2.33)")  # fmt: skip
def test_a_step_sized_block_comes_from_the_heap_and_stays_there() -> None:
    tuned, untuned = _probe("1"), _probe("0")
    assert "keeps freed memory" in tuned["said"] and "INFLIGHT_CPU_MALLOC_TUNING=0" in untuned["said"]
    assert untuned["mmapped"] >= 8 << 20  # glibc alone: a fresh process maps blocks this size one by one
    assert tuned["mmapped"] == 0
    assert tuned["kept_free"] >= STEP_BYTES  # freed, kept in the heap for the next step
    # ... which reuses it: a part of a page in four faulted in again (fragments), against all of it
    assert tuned["faults"] < (STEP_BYTES // 4096) // 3 <= untuned["faults"] // 2
