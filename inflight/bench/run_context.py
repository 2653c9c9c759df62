"""What the machine and each server looked like around a measurement (issue 23's fair bench).

A serving figure on a shared machine means little without its conditions, so the peers bench
reports, beside every result:

* the machine while each load point ran: the 1-minute load average at its start and the share
  of CPU time the hypervisor stole during it (:func:`cpu_times`, :func:`steal_fraction`, from
  ``/proc/stat``);
* each server's turn: seconds from its start to ready and for its first (warm-up) request,
  both kept out of the measurement, and its layout after the load points ran
  (:func:`server_layout`: its processes, their threads, and the CPUs each thread may run on,
  which is how vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` placement shows);
* whether a server's oneDNN computed in float32 (:func:`onednn_check`: the primitives its
  ``ONEDNN_VERBOSE=profile_create`` log says it created, their data types and any ``fpmath``
  attribute, which is how oneDNN would quietly compute a float32 product in bf16).

Knows nothing about workloads, servers' command lines or reports.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STAT = Path("/proc/stat")


@dataclass(frozen=True, slots=True)
class CpuTimes:
    """The machine's CPU time so far (``/proc/stat``'s first line), in clock ticks."""

    total: int
    steal: int


def cpu_times(path: Path = STAT) -> CpuTimes | None:
    """None where the file is missing or has no steal column (not Linux, or a kernel before 2.6.11)."""
    try:
        fields = path.read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time is already
    # inside user and nice, so the total is the first eight.
    ticks = [int(v) for v in fields[1:9]]
    return CpuTimes(sum(ticks), ticks[7])


def steal_fraction(before: CpuTimes | None, after: CpuTimes | None) -> float:
    """Stolen share of all CPU time between two samples; NaN when either is missing or no time passed."""
    if before is None or after is None or after.total <= before.total:
        return float("nan")
    return (after.steal - before.steal) / (after.total - before.total)


def load_1m() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


@dataclass(frozen=True, slots=True)
class ServerLayout:
    """A server's process tree: each process's name, the threads of all of them, and how many
    threads may run on each set of CPUs (``Cpus_allowed_list``), the largest group first."""

    processes: tuple[str, ...]
    threads: int
    placement: tuple[tuple[str, int], ...]


def process_tree(pid: int) -> list[Any]:
    """``psutil.Process`` of ``pid`` and of every process it started; empty if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def server_layout(pid: int) -> ServerLayout | None:
    """The layout of ``pid`` and every process it started; None if it is gone."""
    names: list[str] = []
    allowed: Counter[str] = Counter()
    for p in process_tree(pid):
        proc = Path("/proc") / str(p.pid)
        try:
            names.append((proc / "comm").read_text().strip())
            tids = os.listdir(proc / "task")
        except OSError:
            continue  # exited meanwhile
        for tid in tids:
            cpus = _allowed_cpus(proc / "task" / tid / "status")
            if cpus is not None:
                allowed[cpus] += 1
    if not names:
        return None
    placement = tuple(sorted(allowed.items(), key=lambda kv: (-kv[1], kv[0])))
    return ServerLayout(tuple(names), sum(allowed.values()), placement)


def _allowed_cpus(status: Path) -> str | None:
    try:
        text = status.read_text()
    except OSError:
        return None
    found = re.search(r"^Cpus_allowed_list:\s*(\S+)", text, re.MULTILINE)
    return found.group(1) if found else None


def describe_layout(layout: ServerLayout | None) -> tuple[str, str]:
    """(processes, threads by allowed CPUs) as report cells."""
    if layout is None:
        return "n/a", "n/a"
    names = Counter(layout.processes)
    procs = ", ".join(n if c == 1 else f"{n} x{c}" for n, c in names.items())
    threads = "; ".join(f"CPUs {cpus}: {n}" for cpus, n in layout.placement)
    return f"{len(layout.processes)} ({procs})", f"{layout.threads} ({threads})"


# A primitive-creation line of oneDNN's verbose log (v3):
# onednn_verbose,v1,primitive,create:cache_miss,cpu,matmul,brg_matmul:avx512_core,undef,
#   src:f32::blocked:ab::f0 wei:f32::blocked:BA16a64b::f0 dst:f32::blocked:ab::f0,attr-scratchpad:user,,9x256:256x512,0.29
_CREATE = re.compile(r"^onednn_verbose,(?:v1,)?primitive,create:\w+,cpu,(\w+),([^,]*),[^,]*,([^,]*),([^,]*),")
COMPUTE_KINDS = frozenset({"matmul", "inner_product", "convolution", "deconvolution"})


@dataclass(frozen=True, slots=True)
class OneDnnCheck:
    """The compute primitives (matmul, inner product, convolution) a verbose log shows created:
    how many, the data types of their arguments, their implementations and any fpmath modes."""

    primitives: int
    dtypes: tuple[str, ...]
    implementations: tuple[str, ...]
    fpmath: tuple[str, ...]

    @property
    def float32(self) -> bool:
        """Every compute primitive took and gave f32 with no lower-precision fpmath mode."""
        return self.primitives > 0 and self.dtypes == ("f32",) and all(m in ("strict", "any") for m in self.fpmath)

    def describe(self) -> str:
        if self.primitives == 0:
            return "no oneDNN compute primitive was created (nothing to check)"
        verdict = "fp32" if self.float32 else "**NOT fp32**"
        fpmath = ", ".join(self.fpmath) if self.fpmath else "none"
        return (f"{self.primitives} compute primitives created, argument types {', '.join(self.dtypes)}, "
                f"implementations {', '.join(self.implementations)}, fpmath attributes {fpmath}: {verdict}")


def onednn_check(log_text: str) -> OneDnnCheck:
    """Read a server log written with ``ONEDNN_VERBOSE=profile_create`` (or any level that logs
    creation): the compute primitives' argument data types, implementations and fpmath modes."""
    count = 0
    dtypes: set[str] = set()
    impls: set[str] = set()
    fpmath: set[str] = set()
    for line in log_text.splitlines():
        found = _CREATE.match(line.strip())
        if found is None or found.group(1) not in COMPUTE_KINDS:
            continue
        count += 1
        impls.add(found.group(2))
        for desc in found.group(3).split():
            _arg, _, rest = desc.partition(":")
            dtype = rest.split(":", 1)[0]
            if dtype != "undef":  # an argument the primitive was created without (e.g. no bias)
                dtypes.add(dtype)
        for attr in found.group(4).split():
            if attr.startswith("attr-fpmath:"):
                fpmath.add(attr.split(":", 2)[1])
    return OneDnnCheck(count, tuple(sorted(dtypes)), tuple(sorted(impls)), tuple(sorted(fpmath)))


def per_rep(values: list[float], pattern: str) -> str:
    """Values of the repetitions in order, ``a / b / c``; n/a for NaN."""
    return " / ".join("n/a" if math.isnan(v) else pattern.format(v) for v in values) or "n/a"
