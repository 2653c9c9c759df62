"""The messages between the front end and the engine-core process.

One message per event each way, pickled over a ``multiprocessing`` pipe. The core speaks
first: :class:`Prewarmed` once its imports are done and it has read what the start-up checks
need (``served_facts``). The front end sends :class:`Go` (load the engine: its own start-up
checks passed), then :class:`AddGroup`, :class:`Abort`, :class:`Retune`, :class:`Ping`, the
LoRA calls (:class:`LoadLoRA`, :class:`UnloadLoRA`, :class:`ListLoRAs`) and :class:`Shutdown`;
the core answers with :class:`Ready` (or :class:`LoadFailed`) once, then
:class:`Admitted` / :class:`Refused` per group, :class:`StepDone` per step that produced
outputs (every new token of the step in one message, with the step's stats), :class:`Stats`
after commands, :class:`RetuneDone` (and :class:`Retuned` to every other front end, when
several share the core), :class:`LoRADone` per LoRA call (and :class:`LoRAsChanged` to every
other front end after a load or unload), :class:`Pong` per :class:`Ping` (between two steps: the
heartbeat that shows an idle core alive), :class:`FailAll` when a step raised and :class:`Dead`
before it exits on a fatal error. :data:`PROTOCOL_VERSION` is checked in :class:`Prewarmed`
and :class:`Ready`: both sides come from one install, so a mismatch means a stale process,
and the front end refuses to serve with it.

Everything here is a frozen dataclass of plain values, :class:`EngineStats`,
:class:`EngineConfig`, :class:`SamplingParams`, :class:`LoRAInfo` or :class:`ServedFacts`: nothing that needs
torch. :class:`StepDone`, sent every step, carries its outputs as columns (:func:`step_done`
builds it from the engine's :class:`RequestOutput` values, :meth:`StepDone.outputs` gives them
back), so it pickles at C speed. Knows nothing about processes, pipes or HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from inflight.runtime.core.engine_types import EngineRequest, EngineSummary
from inflight.runtime.engine_core.served_facts import ServedFacts
from inflight.runtime.lora.types import LoRAInfo
from inflight.runtime.outputs import EngineStats, RequestOutput, RequestRejectedError, RequestTimes, TokenLogprob

__all__ = ["EngineRequest", "EngineSummary"]  # defined beside the engine, carried here

# 2: TokenLogprob.rank; 3: EngineStats.tenants; 4: Go; 5: Prewarmed; 6: EngineRequest.cache_salt
# 7: Ping/Pong (the idle core's heartbeat)
# 8: EngineStats.device_busy_seconds (the simulated device's busy time)
# 9: StepDone as columns (req ids, token ids, counts, sparse extras)
# 10: RequestOutput.pooled (a pooling engine's vectors) in StepDone's extras
# 11: EngineStats' prefill backlog, prefill tokens computed and prefill rate
# 12: LoRA (LoadLoRA, UnloadLoRA, ListLoRAs, LoRADone, LoRAsChanged; EngineRequest.lora_name)
# 13: StructuredOutputsParams.checked_grammar (the front end's grammar verdict);
# EngineRequest.mm_inputs (a chat's images: multimodal/inputs.py)
PROTOCOL_VERSION = 15  # 15: EngineStats per KV group (kv_group_names, kv_blocks_held_by_group); 14: SamplingParams.pooling


# ---- front end -> core ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddGroup:
    """Add every request or none. A request's grammar arrives checked by the front end (its
    ``params.structured.checked_grammar``): the core only instantiates it, off the step loop,
    before the group is added."""

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
class LoadLoRA:
    """Load the PEFT adapter at ``path`` as ``name`` between two steps; answered by :class:`LoRADone`."""

    call_id: int
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class UnloadLoRA:
    """Unload adapter ``name`` (requests admitted with it finish with it); answered by :class:`LoRADone`."""

    call_id: int
    name: str


@dataclass(frozen=True, slots=True)
class ListLoRAs:
    """Which adapters are loaded; answered by :class:`LoRADone`."""

    call_id: int


LoRACall = LoadLoRA | UnloadLoRA | ListLoRAs


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


# A row's rare fields, in RequestOutput's order: finished, finish_reason, new_text,
# new_logprobs, times, prompt_logprobs, error, pooled; logprobs and times as plain tuples.
StepExtra = tuple[bool, str | None, str, tuple[Any, ...] | None, tuple[Any, ...] | None, tuple[Any, ...] | None,
                  str | None, bytes | None]  # fmt: skip
PlainLogprobs = tuple[tuple[int, float, tuple[tuple[int, float], ...], int | None], ...]

_ROW = attrgetter("req_id", "new_token_ids", "num_prompt_tokens", "num_output_tokens", "num_cached_tokens",
                  "finished", "finish_reason", "new_text", "new_logprobs", "times", "prompt_logprobs", "error",
                  "pooled")  # fmt: skip
_NO_EXTRA = (False, None, "", None, None, None, None, None)  # a running request's row: no rare field set


@dataclass(frozen=True, slots=True)
class StepDone:
    """One step's outputs as columns (entry i of each is output i), with the step's stats.

    One frozen dataclass per output pickles through dataclasses' Python ``__getstate__``
    (and unpickles through ``__setstate__``); columns of plain values go at C speed. A running
    request's row is its ``req_id``, its new token ids and its counts; what only some rows
    carry (a finish, logprobs, times, an error, text) is in ``extras`` by row index, as a
    :data:`StepExtra`. Build it with :func:`step_done`; :meth:`outputs` gives the values back.
    """

    req_ids: tuple[str, ...]
    new_token_ids: tuple[tuple[int, ...], ...]
    num_prompt_tokens: tuple[int, ...]
    num_output_tokens: tuple[int, ...]
    num_cached_tokens: tuple[int, ...]
    extras: dict[int, StepExtra]
    stats: EngineStats

    def __reduce__(self) -> tuple[Any, ...]:  # the fields as they are: no dataclass __getstate__
        return (StepDone, (self.req_ids, self.new_token_ids, self.num_prompt_tokens, self.num_output_tokens,
                           self.num_cached_tokens, self.extras, self.stats))  # fmt: skip

    def __len__(self) -> int:
        return len(self.req_ids)

    def outputs(self) -> tuple[RequestOutput, ...]:
        """The step's outputs, equal to those :func:`step_done` was given."""
        outs = []
        rows = zip(self.req_ids, self.new_token_ids, self.num_prompt_tokens, self.num_output_tokens,
                   self.num_cached_tokens, strict=True)  # fmt: skip
        for i, (req_id, token_ids, num_prompt, num_output, num_cached) in enumerate(rows):
            extra = self.extras.get(i)
            if extra is None:
                outs.append(RequestOutput(req_id, token_ids, "", False, None, num_prompt, num_output, num_cached))
                continue
            finished, reason, text, logprobs, times, prompt_logprobs, error, pooled = extra
            outs.append(RequestOutput(req_id, token_ids, text, finished, reason, num_prompt, num_output, num_cached,
                                      logprobs_from_plain(logprobs), times_from_plain(times),
                                      logprobs_from_plain(prompt_logprobs), error, pooled))  # fmt: skip
        return tuple(outs)


def step_done(outputs: Sequence[RequestOutput], stats: EngineStats) -> StepDone:
    """The message that carries one step's outputs (those of one front end's requests)."""
    if not outputs:
        return StepDone((), (), (), (), (), {}, stats)
    req_ids, token_ids, num_prompt, num_output, num_cached, *rare = zip(*map(_ROW, outputs), strict=True)
    extras: dict[int, StepExtra] = {}
    if all(column.count(default) == len(req_ids) for column, default in zip(rare, _NO_EXTRA, strict=True)):
        return StepDone(req_ids, token_ids, num_prompt, num_output, num_cached, extras, stats)  # no row has one
    for i, row in enumerate(zip(*rare, strict=True)):
        if row != _NO_EXTRA:
            finished, reason, text, logprobs, times, prompt_logprobs, error, pooled = row
            extras[i] = (finished, reason, text, logprobs_to_plain(logprobs), times_to_plain(times),
                         logprobs_to_plain(prompt_logprobs), error, pooled)  # fmt: skip
    return StepDone(req_ids, token_ids, num_prompt, num_output, num_cached, extras, stats)


def logprobs_to_plain(logprobs: tuple[TokenLogprob, ...] | None) -> PlainLogprobs | None:
    if logprobs is None:
        return None
    return tuple((t.token_id, t.logprob, t.top, t.rank) for t in logprobs)


def logprobs_from_plain(plain: PlainLogprobs | None) -> tuple[TokenLogprob, ...] | None:
    if plain is None:
        return None
    return tuple(TokenLogprob(*t) for t in plain)


def times_to_plain(times: RequestTimes | None) -> tuple[float | None, ...] | None:
    return None if times is None else (times.arrival, times.first_scheduled, times.first_token, times.finished)


def times_from_plain(plain: tuple[Any, ...] | None) -> RequestTimes | None:
    return None if plain is None else RequestTimes(*plain)


@dataclass(frozen=True, slots=True)
class Stats:
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class RetuneDone:
    call_id: int
    summary: EngineSummary | None  # None when refused
    error: str | None = None  # the ValueError's message when refused


@dataclass(frozen=True, slots=True)
class Retuned:
    """Another front end retuned the engine (``--api-server-count`` > 1): its new summary."""

    summary: EngineSummary


@dataclass(frozen=True, slots=True)
class LoRADone:
    """The answer to a :data:`LoRACall`: the adapters loaded after it (all of them), the one a
    :class:`LoadLoRA` loaded (``info``), or why it was refused: ``error`` with ``error_kind``
    ``"refused"`` (the engine's ``LoRAError``: HTTP 400), ``"unknown"`` (``UnknownLoRA``: 404)
    or ``"failed"`` (anything else the engine raised: 500)."""

    call_id: int
    loras: tuple[LoRAInfo, ...]
    info: LoRAInfo | None = None
    error: str | None = None
    error_kind: str | None = None


@dataclass(frozen=True, slots=True)
class LoRAsChanged:
    """Another front end loaded or unloaded an adapter (``--api-server-count`` > 1): all loaded now."""

    loras: tuple[LoRAInfo, ...]


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
