"""The messages between the front end and the engine-core process.

One message per event each way, pickled over a ``multiprocessing`` pipe. The core speaks
first: :class:`Prewarmed` once its imports are done and it has read what the start-up checks
need (``served_facts``). The front end sends :class:`Go` (load the engine: its own start-up
checks passed), then :class:`AddGroup`, :class:`Abort`, :class:`Retune`, :class:`Ping` and
:class:`Shutdown`; the core answers with :class:`Ready` (or :class:`LoadFailed`) once, then
:class:`Admitted` / :class:`Refused` per group, :class:`StepDone` per step that produced
outputs (every new token of the step in one message, with the step's stats), :class:`Stats`
after commands, :class:`RetuneDone`, :class:`Pong` per :class:`Ping` (between two steps: the
heartbeat that shows an idle core alive), :class:`FailAll` when a step raised and :class:`Dead`
before it exits on a fatal error. :data:`PROTOCOL_VERSION` is checked in :class:`Prewarmed`
and :class:`Ready`: both sides come from one install, so a mismatch means a stale process,
and the front end refuses to serve with it.

Everything here is a frozen dataclass of plain values, :class:`RequestOutput`,
:class:`EngineStats`, :class:`EngineConfig`, :class:`SamplingParams` or
:class:`ServedFacts`: nothing that needs torch. Knows nothing about processes, pipes or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inflight.runtime.core.engine_types import EngineRequest, EngineSummary
from inflight.runtime.engine_core.served_facts import ServedFacts
from inflight.runtime.outputs import EngineStats, RequestOutput, RequestRejectedError

__all__ = ["EngineRequest", "EngineSummary"]  # defined beside the engine, carried here

# 2: TokenLogprob.rank; 3: EngineStats.tenants; 4: Go; 5: Prewarmed; 6: EngineRequest.cache_salt
# 7: Ping/Pong (the idle core's heartbeat)
PROTOCOL_VERSION = 8  # 8: EngineStats.device_busy_seconds (the simulated device's busy time)


# ---- front end -> core ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddGroup:
    """Add every request or none (grammars compile first, off the step loop)."""

    group_id: int
    requests: tuple[EngineRequest, ...]


@dataclass(frozen=True, slots=True)
class Abort:
    req_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Retune:
    call_id: int
    changes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class Go:
    """The front end's first message: load the engine now (its checks passed)."""


@dataclass(frozen=True, slots=True)
class Ping:
    """A heartbeat: answer with :class:`Pong` of the same ``seq`` between two steps."""

    seq: int


# ---- core -> front end ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prewarmed:
    """The first message: the core imported the engine and read the model's facts. ``problem``:
    why they refuse this start (a ``ValueError``'s line); ``facts`` is None with it, and also
    when reading them failed otherwise (the front end then reads them itself)."""

    version: int
    facts: ServedFacts | None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class Ready:
    version: int
    summary: EngineSummary
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class LoadFailed:
    error: str


@dataclass(frozen=True, slots=True)
class Admitted:
    group_id: int


@dataclass(frozen=True, slots=True)
class Refused:
    group_id: int
    error: RequestRejectedError


@dataclass(frozen=True, slots=True)
class StepDone:
    outputs: tuple[RequestOutput, ...]
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Stats:
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class RetuneDone:
    call_id: int
    summary: EngineSummary | None  # None when refused
    error: str | None = None  # the ValueError's message when refused


@dataclass(frozen=True, slots=True)
class Pong:
    """The answer to :class:`Ping` ``seq``: the core's loop is running (not frozen, not stuck)."""

    seq: int


@dataclass(frozen=True, slots=True)
class FailAll:
    """A step raised: the requests in flight were failed (the core goes on)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Dead:
    """The core cannot go on and exits next."""

    reason: str
