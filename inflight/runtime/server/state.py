"""The per-app server state every handler reaches through ``request.app[STATE]``.

Owns the settings (served name, API key, drain timeout, body limit), the lifecycle flags
(loading / ready / draining), the in-flight request count used for graceful drain, and
references to the async engine and the metrics. No module-level mutable state: each app
gets its own ``ServerState``. Knows nothing about the OpenAI schemas.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from dataclasses import dataclass

from aiohttp import web

from inflight.runtime.server.async_engine import AsyncEngine
from inflight.runtime.server.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Server knobs that are not engine knobs (those live in ``EngineConfig``)."""

    model_name: str
    api_key: str | None = None
    drain_timeout_s: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name must be a non-empty string (use --served-model-name).")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain timeout must be >= 0 seconds (got {self.drain_timeout_s}).")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024 (got {self.max_body_bytes}).")


class ServerState:
    """Mutable state of one running app (touched on the event loop only)."""

    def __init__(self, settings: ServerSettings, engine: AsyncEngine, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        self.draining = False
        self.num_in_flight = 0
        self.tasks: set[asyncio.Task[object]] = set()  # handlers in flight, cancelled at drain timeout
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{self._id_prefix}{next(self._ids):06d}"

    def request_started(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)

    def request_finished(self) -> None:
        self.num_in_flight -= 1
        task = asyncio.current_task()
        if task is not None:
            self.tasks.discard(task)
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; false when ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


STATE: web.AppKey[ServerState] = web.AppKey("inflight_state", ServerState)
