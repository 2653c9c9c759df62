"""The gpu-check's children: a command run with its output in a log file, and a child past its
time killed together with everything it started (servers, pytest workers), read from
``/proc`` (the bare GPU machine has no psutil). Knows nothing about what the steps check.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def run_logged(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd`` with its output in ``log``; (exit code, the output's last 4000 chars).
    Past ``timeout_s`` it and its descendants are killed and the code is 124."""
    full_env = {**os.environ, **(env or {})}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env)
        rc = wait_or_kill(proc, timeout_s)
    text = log.read_text(errors="replace")
    if rc == 124:
        text += f"\n[gpu-check: killed after {timeout_s:.0f} s]"
    return rc, text[-4000:]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (Linux ``/proc``; none elsewhere), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> int:  # type: ignore[type-arg]
    """``proc``'s exit code; past ``timeout_s`` it is killed with every descendant (servers in
    sessions of their own too, pytest's workers) and the code is 124."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    for pid in [*_descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    proc.wait()
    return 124
