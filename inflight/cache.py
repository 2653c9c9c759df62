"""Where inflight keeps what it builds or converts on a machine (converted GGUF models, the
native CPU kernels): ``INFLIGHT_CACHE_DIR``, else ``$XDG_CACHE_HOME/inflight``, else
``~/.cache/inflight``. Imports nothing heavy; knows nothing about what is stored."""

from __future__ import annotations

import os
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
