"""The standard ``process_*`` and ``python_*`` series of one server's registry.

One front end: prometheus_client's own collectors, as vLLM's default registry has them: the
process answering the scrape (CPU seconds, resident and virtual memory, open and maximum file
descriptors, start time), ``python_info`` and the garbage collector's counters.

Several front ends (``--api-server-count N``): a scrape reaches whichever front end the kernel
handed the connection, so the scraped process's own figures would change process from one scrape
to the next (a ``rate()`` of ``process_cpu_seconds_total`` across them is meaningless), and
prometheus_client's multiprocess mode only sums what its metrics wrote to files (vLLM, in that
mode, exports no ``process_*`` or ``python_*`` at all). Here each front end leaves a marker
``process-<pid>`` in the shared metrics directory, and every scrape reads ``/proc/<pid>`` of each
(one pod, one PID namespace): ``process_*`` once per front end, told apart by a ``pid`` label.
``python_info`` is the same in every front end and is kept; the garbage collector's counters live
in each interpreter and cannot be read from another process, so they are left out in that mode.
The engine-core process is not covered in either mode (vLLM's front end reports only itself too).
Knows nothing about the engine or HTTP.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

MARKER_PREFIX = "process-"  # MultiProcessCollector reads only *.db files: the markers are not its


def add_process_collectors(registry: CollectorRegistry, shared_dir: str | None) -> None:
    """Register the ``process_*`` and ``python_*`` collectors on ``registry``; ``shared_dir``:
    the front ends' shared metrics directory (several front ends), or None (one)."""
    PlatformCollector(registry=registry)
    if shared_dir is None:
        ProcessCollector(registry=registry)
        GCCollector(registry=registry)
        return
    Path(shared_dir, f"{MARKER_PREFIX}{os.getpid()}").touch()
    registry.register(FrontEndProcessCollector(shared_dir))


class FrontEndProcessCollector(Collector):
    """``process_*`` of every front end that marked the shared directory, labelled ``pid``."""

    def __init__(self, shared_dir: str, proc: str = "/proc") -> None:
        self._dir = Path(shared_dir)
        self._proc = proc
        self._readers: dict[int, ProcessCollector] = {}

    def pids(self) -> list[int]:
        found = []
        for path in self._dir.glob(f"{MARKER_PREFIX}*"):
            suffix = path.name[len(MARKER_PREFIX):]
            if suffix.isdigit():
                found.append(int(suffix))
        return sorted(found)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for pid in self.pids():
            reader = self._readers.get(pid)
            if reader is None:
                reader = self._readers[pid] = ProcessCollector(pid=lambda pid=pid: pid, proc=self._proc,
                                                               registry=None)
            for family in reader.collect():  # nothing for a process that has gone
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "pid": str(pid)}, sample.value)
        yield from merged.values()
