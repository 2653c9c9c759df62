"""The activator's per-backend state: where a backend is, whether it is ready, and the requests
held for it.

Owns ``Backend`` (its URL, readiness, the bounded queue of held requests, what is in flight,
when it was last active) and ``Backends`` (the table, keyed ``namespace/name``, with the
bounds). A held request is a future resolved ``True`` when the backend turns ready and
``False`` when its wait bound passes (``expire``); a full queue refuses at once (``hold``
returns ``None``). Time comes from the caller. Knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True, slots=True)
class Limits:
    """The activator's bounds (the chart's ``activator`` values)."""

    max_held: int = 100  # requests held per backend; past it: 503 at once
    hold_timeout_s: float = 300.0  # how long one request is held; past it: 503
    retry_after_s: int = 30  # the Retry-After a 503 carries
    registration_grace_s: float = 30.0  # unknown backends are held this long after start, then 404
    probe_interval_s: float = 1.0  # while requests are held: probe the backend's /ready this often
    backend_template: str = "http://{name}.{namespace}.svc:{port}"

    def __post_init__(self) -> None:
        if self.max_held < 1:
            raise ValueError(f"max_held must be >= 1 (got {self.max_held}).")
        for name in ("hold_timeout_s", "probe_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)}).")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1 (got {self.retry_after_s}).")
        if self.registration_grace_s < 0:
            raise ValueError(f"registration_grace_s must be >= 0 (got {self.registration_grace_s}).")
        if "{port}" not in self.backend_template:
            raise ValueError(f"backend_template must contain {{port}} (got {self.backend_template!r}).")


@dataclass(slots=True)
class Held:
    deadline: float
    woken: asyncio.Future[bool]  # True: the backend is ready; False: the wait bound passed


@dataclass(slots=True)
class Demand:
    """What the operator reads back: requests held and in flight, and seconds since the backend
    last had either (0 while it has some)."""

    held: int
    in_flight: int
    idle_seconds: float

    def as_json(self) -> dict[str, float | int]:
        return {"held": self.held, "inFlight": self.in_flight, "idleSeconds": round(self.idle_seconds, 3)}


@dataclass(slots=True)
class Backend:
    key: str  # namespace/name
    last_active: float
    url: str | None = None  # None until the operator reports the backend
    replicas: int | None = None  # the Deployment's replicas as the operator last reported them
    ready: bool = False
    held: list[Held] = field(default_factory=list)
    in_flight: int = 0
    probing: bool = False

    def hold(self, now: float, limits: Limits) -> Held | None:
        """Queue one request until ready or ``now + hold_timeout_s``; None when the queue is full."""
        if len(self.held) >= limits.max_held:
            return None
        held = Held(now + limits.hold_timeout_s, asyncio.get_running_loop().create_future())
        self.held.append(held)
        self.last_active = now
        return held

    def release(self, held: Held) -> None:
        """Take ``held`` off the queue (answered, timed out or its client gone)."""
        if held in self.held:
            self.held.remove(held)

    def set_ready(self, ready: bool) -> None:
        """Readiness as seen by a probe or a failed forward; ready wakes every held request."""
        self.ready = ready
        if ready:
            for held in self.held:
                if not held.woken.done():
                    held.woken.set_result(True)

    def expire(self, now: float) -> int:
        """Wake (with False) every held request past its deadline; returns how many."""
        expired = 0
        for held in self.held:
            if now >= held.deadline and not held.woken.done():
                held.woken.set_result(False)
                expired += 1
        return expired

    def start(self, now: float) -> None:
        self.in_flight += 1
        self.last_active = now

    def finish(self, now: float) -> None:
        self.in_flight -= 1
        self.last_active = now

    def demand(self, now: float) -> Demand:
        busy = bool(self.held) or self.in_flight > 0
        return Demand(len(self.held), self.in_flight, 0.0 if busy else max(0.0, now - self.last_active))


class Backends:
    """The activator's table of backends, keyed ``namespace/name``."""

    def __init__(self, limits: Limits, started_at: float) -> None:
        self.limits = limits
        self.started_at = started_at
        self._by_key: dict[str, Backend] = {}

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self._by_key.values()))

    def get(self, namespace: str, name: str) -> Backend | None:
        return self._by_key.get(f"{namespace}/{name}")

    def lookup(self, namespace: str, name: str, now: float) -> Backend | None:
        """The backend a request names: a known one, or (within the registration grace after
        start, before the operator's first report) a new one to hold for; None: unknown."""
        found = self.get(namespace, name)
        if found is not None:
            return found
        if now - self.started_at >= self.limits.registration_grace_s:
            return None
        return self._by_key.setdefault(f"{namespace}/{name}", Backend(f"{namespace}/{name}", last_active=now))

    def report(self, namespace: str, name: str, port: int, replicas: int, now: float) -> Backend:
        """The operator's report: where the backend is and its replicas. At 0 replicas the
        backend stops counting as ready (the next request is held)."""
        backend = self._by_key.setdefault(f"{namespace}/{name}", Backend(f"{namespace}/{name}", last_active=now))
        backend.url = self.limits.backend_template.format(name=name, namespace=namespace, port=port)
        backend.replicas = replicas
        if replicas == 0:
            backend.ready = False
        return backend
