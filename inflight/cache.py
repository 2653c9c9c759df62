"""Where inflight keeps what it builds or converts on a machine (converted GGUF models, the
native CPU kernels): ``INFLIGHT_CACHE_DIR``, else ``$XDG_CACHE_HOME/inflight``, else
``~/.cache/inflight``; and :func:`building`, the lock that lets one process at a time make a
thing there (two servers started at once on one GGUF file convert it once). Imports nothing
heavy; knows nothing about what is stored."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from inflight import env_vars

CACHE_ENV = "INFLIGHT_CACHE_DIR"


def cache_root() -> Path:
    """The cache root, read from the environment at each call."""
    root = env_vars.read_str(CACHE_ENV)
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inflight"


@contextmanager
def building(target: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``target`` (a file ``.<name>.lock`` beside it, kept) while the
    caller checks whether it exists and makes it; another process waits, then finds it made.
    The lock goes with the process, so one that dies while building blocks nobody."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
