"""Request: the engine's mutable record of one generation request as it moves through states.

A request is WAITING (not admitted, or preempted and waiting to be recomputed), RUNNING
(holds KV blocks, is scheduled every step) or FINISHED. ``num_computed_tokens`` counts the
tokens whose K/V are in the cache; the scheduler hands out the rest in chunks. ``block_ids`` is
the request's block table (entry ``i`` holds positions ``i * block_size ..``); on a model whose
every layer is windowed its first ``num_released_blocks`` entries are placeholders for blocks
already given back (see :mod:`inflight.runtime.core.kv_manager`). :func:`chunk_of` copies what the
device side reads of a request into a plain :class:`ScheduledChunk`; the device side never sees a
``Request``. Imports no torch and knows nothing about the model.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Sequence
from typing import overload

from inflight.runtime.core.sched_output import DraftContext, RequestFacts, ScheduledChunk
from inflight.runtime.lora.types import LoRARef
from inflight.runtime.multimodal.inputs import MultimodalInputs
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.speculative import NgramIndex


class TokenRange(Sequence[int]):
    """``token_ids[start:stop]`` without the copy: an O(1) snapshot of a request's tokens, valid
    because a request's ``token_ids`` never change below their length at the time (tokens are
    only appended; async scheduling's placeholder is appended after, and dropped from, the end).
    A pipelined speculating step leaves several placeholders, which fewer tokens may replace: the
    sampling rows taken over them are only those of requests whose rows read no output
    (core/spec_pipeline.py, ``pipelined_params``)."""

    __slots__ = ("_ids", "_start", "_stop")

    def __init__(self, token_ids: list[int], start: int, stop: int) -> None:
        self._ids, self._start, self._stop = token_ids, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self._ids[self._start : self._stop][index]
        n = self._stop - self._start
        if not -n <= index < n:
            raise IndexError("token index out of range")
        return self._ids[self._start + index % n]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids[self._start : self._stop])

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like a list

    def __repr__(self) -> str:
        return f"TokenRange({list(self)!r})"


_new_chunk = tuple.__new__  # ScheduledChunk without its Python-level __new__ (chunk_of runs per row per step)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One request's tokens, KV blocks and progress."""

    # Slots: the step reads these per row, and past 30 attributes CPython (3.11) stops sharing an
    # instance dict's keys, which slows every attribute read; a new attribute is named here too.
    __slots__ = ("req_id", "prompt_token_ids", "params", "priority", "arrival_time", "arrival_seq", "tenant",
                 "cache_salt", "lora", "mm_inputs", "token_ids", "status", "num_computed_tokens", "num_cached_tokens",
                 "block_ids", "num_released_blocks", "block_hashes", "num_cached_blocks", "num_preemptions",
                 "admitted_seq", "finish_reason", "first_scheduled_time", "first_token_time", "ngram", "draft_kv_lag",
                 "parked", "in_flight", "spec_pipelined", "pooled_part", "facts", "_table", "_table_of",
                 "group_block_ids", "group_released", "_groups_table", "__weakref__")

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        arrival_seq: int = 0,
        tenant: str = "",
        cache_salt: str | None = None,
        lora: LoRARef | None = None,
        mm_inputs: MultimodalInputs | None = None,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_seq = arrival_seq  # tie-breaker: order of add_request calls
        self.tenant = tenant  # the scheduler's fair policy shares slots between tenants
        self.cache_salt = cache_salt  # seeds block_hashes: only requests with the same salt share KV
        self.lora = lora  # its LoRA adapter (None: the base model); kept through preemption, keys its KV too
        self.mm_inputs = mm_inputs  # its images (vision-language models); their hashes key its KV blocks too
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + output
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_ids: list[int] = []  # the block table, placeholders included
        self.num_released_blocks = 0  # leading entries of block_ids no longer held (out of the window)
        self.block_hashes: list[bytes] = []  # chained SHA-256 keys of the full blocks of token_ids (from the salt)
        self.num_cached_blocks = 0  # leading blocks registered in the prefix cache
        self.num_preemptions = 0
        self.admitted_seq = -1  # order of the latest admission (for preemption victims)
        self.finish_reason: str | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.ngram: NgramIndex | None = None  # speculative decoding: this sequence's n-gram index
        # Draft-model speculation: trailing computed positions whose draft-model KV is not written
        # yet (0, or 1 after a step kept every draft; an EAGLE-3 head's: up to the last step's
        # positions, spec_decode/eagle3.py); the next draft pass writes them.
        self.draft_kv_lag = 0
        self.parked = False  # waiting for its grammar's token mask: not scheduled (see runtime/parked.py)
        self.in_flight = False  # in a pipeline step not yet back: not scheduled, never preempted (engine_batch_queue)
        self.spec_pipelined = False  # async scheduling: it drafts in pipelined steps (core/spec_pipeline.py)
        self.pooled_part: object = None  # a pooling engine's partial result (core/pooling_step.py)
        self.facts = self.new_facts()  # what its chunks tell the device side: made again at each admission
        self._table: tuple[int, ...] = ()  # block_ids as a tuple, for the chunks (see block_table)
        self._table_of: list[int] | None = None  # the block_ids list _table copies
        # Per-group KV tables (core/kv_groups.py): every group's block ids (group 0's list is block_ids)
        # and how many leading entries of each are released placeholders; None: one table
        self.group_block_ids: list[list[int]] | None = None
        self.group_released: list[int] = []
        self._groups_table: tuple[object, int, tuple[tuple[int, ...], ...]] | None = None  # see group_tables

    def new_facts(self) -> RequestFacts:
        """The device side's facts of this request for a new stay in the running set."""
        lora = self.lora
        return RequestFacts(self.req_id, len(self.prompt_token_ids), self.params.prompt_logprobs,
                            None if lora is None else lora.load_id, self.mm_inputs, self.params.max_tokens)  # fmt: skip

    def block_table(self) -> tuple[int, ...]:
        """``block_ids`` as a tuple, copied again only when it changed: the table is append-only
        while the request holds blocks, and a new list once they are freed."""
        ids = self.block_ids
        if len(self._table) != len(ids) or self._table_of is not ids:
            self._table, self._table_of = tuple(ids), ids
        return self._table

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    def output_token_range(self) -> TokenRange:
        """The output tokens as they are now, without copying them (see :class:`TokenRange`)."""
        return TokenRange(self.token_ids, len(self.prompt_token_ids), len(self.token_ids))

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def awaits_token(self) -> bool:
        """Async scheduling: its last token is a placeholder for one the step in flight samples."""
        return bool(self.token_ids) and self.token_ids[-1] < 0

    @property
    def awaits_drafts(self) -> bool:
        """Async scheduling: the step in flight speculates for it (its last two tokens are
        placeholders), so how many tokens it emits is unknown until that step is read
        (core/spec_pipeline.py): preempted, it boards again only then."""
        ids = self.token_ids
        return len(ids) >= 2 and ids[-2] < 0

    @property
    def num_held_blocks(self) -> int:
        """Blocks this request holds a reference on (its table less the released placeholders)."""
        return len(self.block_ids) - self.num_released_blocks

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.req_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens}, blocks={self.num_held_blocks}/{len(self.block_ids)})"
        )


def chunk_of(
    req: Request, num_tokens: int, sample: bool, draft_token_ids: tuple[int, ...] = (), num_model_drafts: int = 0,
    draft_context: bool = False,
) -> ScheduledChunk:
    """``num_tokens`` positions of ``req`` from its ``num_computed_tokens``, as plain data (a
    speculating chunk feeds its last known token, then its drafts). ``draft_context``: add what a
    model drafter reads beyond the chunk (:class:`DraftContext`). Runs once per row per step:
    kept to the copies it must make (the block table only when it changed, see :meth:`Request.block_table`)."""
    start = req.num_computed_tokens
    token_ids = req.token_ids
    speculating = num_model_drafts > 0 or bool(draft_token_ids)
    ids = (token_ids[start],) if num_tokens == 1 or speculating else token_ids[start : start + num_tokens]
    block_ids, table = req.block_ids, req._table
    if len(table) != len(block_ids) or req._table_of is not block_ids:  # Request.block_table, inlined
        table = req._table = tuple(block_ids)
        req._table_of = block_ids
    context = None
    if draft_context:
        stop = start + num_tokens
        context = DraftContext(tuple(token_ids[start - min(req.draft_kv_lag, start) : start]),
                               token_ids[stop] if not speculating and stop < len(token_ids) else None)  # fmt: skip
    return _new_chunk(ScheduledChunk, (req.req_id, start, num_tokens, ids, table, sample, req.facts, draft_token_ids,
                                       num_model_drafts, context, group_tables(req)))  # fmt: skip


def decode_chunk(req: Request) -> ScheduledChunk:
    """``chunk_of(req, 1, True)``: a decode's chunk (its last token) without a draft context, the
    one chunk most steps make per row, so spelled out for speed."""
    start = req.num_computed_tokens
    block_ids, table = req.block_ids, req._table
    if len(table) != len(block_ids) or req._table_of is not block_ids:  # Request.block_table, inlined
        table = req._table = tuple(block_ids)
        req._table_of = block_ids
    return _new_chunk(ScheduledChunk, (req.req_id, start, 1, (req.token_ids[start],), table, True, req.facts, (), 0,
                                       None, group_tables(req)))  # fmt: skip


def group_tables(req: Request) -> tuple[tuple[int, ...], ...] | None:
    """Every group's block table as tuples (None: the request has one table for every layer), copied
    again only when they changed: every group's table has the same length (an entry, held or a
    placeholder, per block of the sequence), and entries are only ever appended while held."""
    groups = req.group_block_ids
    if groups is None:
        return None
    cached = req._groups_table
    if cached is None or cached[0] is not groups or cached[1] != len(groups[0]):
        cached = req._groups_table = (groups, len(groups[0]), tuple(map(tuple, groups)))
    return cached[2]
