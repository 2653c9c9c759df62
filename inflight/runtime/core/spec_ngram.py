"""N-gram drafts proposed on the step worker, for speculating steps pipelined under async scheduling
(:mod:`.spec_pipeline`).

The scheduler proposes n-gram drafts from a request's host tokens, which a request whose step in
flight has not been read yet does not have: its last token is a placeholder. For such a request
it schedules room for the drafts, and this proposer fills them in on the worker, once step N is
verified there: the request's history is its token list up to the first position step N could
change (read as it is: the engine thread only ever pops and appends past it) followed by what N
emitted, and the drafts are the synchronous scheduler's
(:class:`~inflight.runtime.spec_decode.speculative.NgramIndex` over the same tokens, up to the
same count). A chunk left without a match runs as a plain decode.
An index is kept per request's stay in the running set (weakly, by its
:class:`~inflight.runtime.core.sched_output.RequestFacts`); reads plain chunks and the token
lists it is handed, and writes no request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

from inflight.runtime.core.async_launched import RowOutcome
from inflight.runtime.core.sched_output import RequestFacts, ScheduledChunk
from inflight.runtime.spec_decode.proposal import Proposal
from inflight.runtime.spec_decode.speculative import NgramIndex, SpeculativeConfig
from inflight.runtime.worker.sampler import SamplingRow

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.core.request import Request


class WorkerNgram:
    """The n-gram proposer of pipelined speculating steps (see module docstring)."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max
        self._indexes: WeakKeyDictionary[RequestFacts, NgramIndex] = WeakKeyDictionary()
        self._histories: Mapping[str, list[int]] = {}
        self._rows: Mapping[str, RowOutcome] = {}

    @classmethod
    def of(cls, engine: LLMEngine) -> WorkerNgram | None:
        """``engine``'s proposer, when it speculates with n-grams (None otherwise)."""
        spec = engine.scheduler.planner.spec
        return cls(spec) if spec is not None and spec.method == "ngram" else None

    @staticmethod
    def histories(chunks: Sequence[ScheduledChunk], requests: Sequence[Request]) -> dict[str, list[int]]:
        """On the host, at launch: the token lists (live) of the requests whose drafts it proposes."""
        return {c.req_id: r.token_ids for c, r in zip(chunks, requests, strict=True) if c.num_model_drafts}

    def bind(self, histories: Mapping[str, list[int]], rows: Mapping[str, RowOutcome]) -> None:
        """The step's token lists (a request's own, live) and each request's outcome of step N."""
        self._histories, self._rows = histories, rows

    def take_kv_lags(self) -> dict[str, int]:
        return {}  # no drafter KV

    def propose(self, chunks: Sequence[ScheduledChunk], sampling_row: Callable[[str], SamplingRow]) -> Proposal:
        """Each chunk that has room for drafts (``num_model_drafts``) with its drafts filled in,
        or as a plain decode where none match; the others as they are."""
        out = []
        for chunk in chunks:
            if chunk.num_model_drafts:
                drafts = self._drafts(chunk)
                chunk = chunk._replace(num_tokens=1 + len(drafts), num_model_drafts=0, draft_token_ids=drafts)
            out.append(chunk)
        return Proposal(tuple(out), {})

    def _drafts(self, chunk: ScheduledChunk) -> tuple[int, ...]:
        row = self._rows.get(chunk.req_id)
        live = self._histories.get(chunk.req_id)
        if row is None or live is None or row.tokens[-1] < 0:  # its request ended: the row is thrown away
            return ()
        stable = chunk.start - (len(row.tokens) - 1)  # the positions before step N's emitted tokens
        history = [*live[:stable], *row.tokens]
        if len(history) != chunk.start + 1 or min(history[-len(row.tokens) - 1 :], default=0) < 0:
            raise RuntimeError(f"request {chunk.req_id!r}: its n-gram history does not reach its chunk")
        index = self._indexes.get(chunk.facts)
        if index is None:
            index = self._indexes[chunk.facts] = NgramIndex(self.min_n, self.max_n)
        return tuple(index.propose(history, chunk.num_model_drafts))
