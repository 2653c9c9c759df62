"""Resident memory of a process tree, read from Linux ``/proc``.

Owns reading, for one root pid and every process below it, VmRSS (``/proc/<pid>/status``)
and PSS (``/proc/<pid>/smaps_rollup``), and summing them. Summed RSS counts pages shared
between the processes once per process; PSS splits them. Knows nothing about which server
the tree belongs to or how the figures are reported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ProcMemory:
    pid: int
    name: str
    rss_kib: int
    pss_kib: int | None  # from smaps_rollup; None where unreadable


def status_kib(text: str, key: str = "VmRSS") -> int | None:
    """The ``key:`` line of a /proc status or smaps_rollup text, in KiB (None when absent)."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == key:
            return int(rest.split()[0])
    return None


def descendants(root: int, parents: Mapping[int, int]) -> list[int]:
    """``root`` and every process below it, given each pid's parent pid."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += sorted(children.get(pid, ()))
    return out


def read_parents(proc: Path = Path("/proc")) -> dict[int, int]:
    """pid -> parent pid for every process now running (field 4 of /proc/<pid>/stat)."""
    parents = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rpartition(")")[2].split()[1])
    return parents


def tree_memory(root: int, proc: Path = Path("/proc")) -> list[ProcMemory]:
    """VmRSS (and PSS) of ``root`` and its descendants; processes gone meanwhile are left out."""
    out = []
    for pid in descendants(root, read_parents(proc)):
        try:
            status = (proc / str(pid) / "status").read_text()
        except OSError:
            continue
        try:
            pss = status_kib((proc / str(pid) / "smaps_rollup").read_text(), "Pss")
        except OSError:
            pss = None
        name = next((ln.split(":", 1)[1].strip() for ln in status.splitlines() if ln.startswith("Name:")), "?")
        out.append(ProcMemory(pid, name, status_kib(status) or 0, pss))
    return out


def total_mib(procs: Sequence[ProcMemory], pss: bool = False) -> float:
    """Summed RSS (or PSS) of ``procs`` in MiB."""
    return sum((p.pss_kib or 0) if pss else p.rss_kib for p in procs) / 1024
