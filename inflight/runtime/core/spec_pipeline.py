"""Speculating steps pipelined under async scheduling: what lets step N+1 carry drafts while
step N, which speculates too, is still running (:mod:`inflight.runtime.core.async_steps`).

A speculating row's next position depends on how many of its drafts the target keeps, which
only step N's verification says. vLLM's answer, and this one: the engine thread schedules N+1
**optimistically**, as if every draft of N were kept. Step N's chunk of ``1 + k`` tokens
advances its request by ``1 + k`` at launch and leaves ``1 + k`` placeholders for its tokens
(each ``placeholder(row)``), so N+1's chunk starts ``k - a`` positions too late when N keeps
``a`` drafts, inside blocks that were allocated for the optimistic positions (a superset of the
real ones). The fix-ups:

- **On the worker**, where N's verification has already run (the worker's own host read, not
  the engine thread's), :func:`rebind` makes N+1's chunks the ones the synchronous scheduler would
  have made: each chunk whose last token is a placeholder of a row of N starts ``k - a`` earlier,
  feeds N's last emitted token, carries the draft context the synchronous engine gives it (the
  drafter's KV lag after N, one more after a row that kept every draft: its last draft was never
  fed to the drafter), and has its drafts trimmed to the ``max_tokens`` and context caps of its
  real count (the host capped them by ``max_tokens`` as if N's drafts were all rejected,
  :func:`~inflight.runtime.core.spec_planning.drafts_in_flight`). The drafter proposes over those
  chunks, they are packed there, and the forward runs; the verification job (:func:`verify_job`)
  then verifies N+1's drafts and samples its plain rows, as the synchronous step does.
- **On the engine thread**, reading N (:meth:`StepPipeline._resolve`) subtracts each row's
  drafts not kept (trimmed or rejected) from its request's computed count and from N+1's chunk
  for it (:func:`shifted`), so both sides agree on every position without the engine thread
  waiting for N before scheduling N+1.

**Which requests.** The engine pipelines speculation with every method (a draft model, an
EAGLE-3 head, an MTP layer, or n-grams: those of a request whose step in flight is not read yet
are proposed on the worker from its history, :mod:`.spec_ngram`), for a model without recurrent
state, images or a sliding window
(:func:`pipelines_speculation`); under tensor parallelism rank 0's worker proposes and
broadcasts each rebound step as the synchronous engine does. A request takes part when nothing
in its sampling row depends on tokens the engine thread does not have yet: no penalties, no
``min_tokens``, no grammar (:func:`pipelined_params`); greedy or sampled. Any other request that
may draft makes the pipeline wait for the step in flight, as before (the synchronous cost). A
request preempted while its step in flight speculates boards again only once that step is read
(``Request.awaits_drafts``: its placeholders stand for tokens of unknown number, which a prompt
chunk cannot feed).

Each request drafts and draws as in the synchronous speculating engine: the worker runs the same
drafter passes, forwards and verifications over the same chunks, and a sampled request's
generator is drawn from only there, in the same order; so greedy and seeded tokens, and the
speculation counters, are that engine's (unless the step's token budget or the context length
caps a request's drafts, where the host's optimistic count may cap them lower). Knows nothing about
the model or kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from inflight.runtime.core.async_launched import Launched, RowOutcome, Sampled, drop_placeholder
from inflight.runtime.core.output_processor import SampledTokens
from inflight.runtime.core.request import Request, RequestStatus, chunk_of
from inflight.runtime.core.sched_output import DraftContext, ScheduledChunk
from inflight.runtime.core.spec_planning import SpecPlanner, drafts_cap
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.verify import verify_chunks
from inflight.runtime.worker.batch_inputs import packed_order
from inflight.runtime.worker.batched_sampling import row_index
from inflight.runtime.worker.sampler import PendingSample, SamplerOutput, SamplingRow, SettledMasks

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine
    from inflight.runtime.core.spec_ngram import WorkerNgram
    from inflight.runtime.outputs import RequestOutput


def pipelines_speculation(engine: LLMEngine) -> bool:
    """Whether ``engine``'s speculating steps may be pipelined (see module docstring): it
    speculates (a model drafter, or n-grams), with no recurrent state, no images and no sliding
    window (the scheduler releases a windowed request's blocks by its computed count, which runs
    ahead here)."""
    runner, spec = engine.runner, engine.scheduler.planner.spec
    return (spec is not None and (engine.drafter is not None or spec.method == "ngram") and not runner.spec.state_layers
            and getattr(runner, "vision", None) is None and engine.kv.sliding_window is None)  # fmt: skip


def pipelined_params(params: SamplingParams) -> bool:
    """Whether a request with ``params`` may speculate in pipelined steps: its sampling rows read
    no output token (no penalties, no ``min_tokens``, no grammar). A sampled request's generator
    is only ever drawn from on the worker, in the synchronous engine's order (the drafter's draws,
    then the verification's), so seeded requests draw the same numbers."""
    return not params.needs_penalties and not params.min_tokens and params.structured is None


def sampled_in_packed_order(chunks: Sequence[ScheduledChunk]) -> tuple[ScheduledChunk, ...]:
    """The sampling chunks in the order the batch packs them
    (:func:`~inflight.runtime.worker.batch_inputs.packed_order`), before their drafts are proposed."""
    return tuple(c for c in packed_order(chunks, proposed=False) if c.sample)


def outcomes_of(sampled: Sampled) -> tuple[RowOutcome, ...]:
    """Each sampled row's outcome (on the worker; a plain step's tokens are read from the device
    and carry no drafter context: its chunks keep the one they were scheduled with)."""
    if sampled.outcomes is not None:
        return sampled.outcomes
    return tuple(RowOutcome((token,)) for token in sampled.token_ids.tolist())


def rebind(chunks: Sequence[ScheduledChunk], outcomes: Sequence[RowOutcome] | None,
           max_model_len: int) -> tuple[ScheduledChunk, ...]:  # fmt: skip
    """Step N+1's chunks as the synchronous scheduler would make them once step N's ``outcomes``
    are known: a chunk whose last token is a placeholder for row ``r`` of N starts N's rejected
    drafts earlier and feeds the row's last token, its drafts are trimmed to the ``max_tokens``
    and context caps of its real count (the host capped them as if N's were all rejected), and a
    model drafter's context is made again from the row's known tokens and lag. A row not sampled
    (its request ended) feeds token 0: its row is thrown away."""
    if outcomes is None:
        return tuple(chunks)
    out: list[ScheduledChunk] = []
    for chunk in chunks:
        ids = chunk.token_ids
        if ids[-1] >= 0:
            out.append(chunk)
            continue
        row = outcomes[-1 - ids[-1]]
        context = chunk.draft_context
        if context is not None and row.known is not None:
            lagging = row.known[max(0, len(row.known) - row.lag) :] if row.lag else ()
            context = DraftContext(lagging, context.next_token_id if len(ids) > 1 else None)
        start = chunk.start - row.rejected
        chunk = chunk._replace(start=start, token_ids=(*ids[:-1], max(row.tokens[-1], 0)), draft_context=context)
        facts = chunk.facts
        if chunk.num_model_drafts and facts.max_tokens is not None:  # its last token at start: start + 1 tokens
            k = drafts_cap(chunk.num_model_drafts, facts.max_tokens, start + 1, facts.num_prompt_tokens, max_model_len)
            if k < chunk.num_model_drafts:
                chunk = chunk._replace(num_tokens=1 + max(k, 0), num_model_drafts=max(k, 0))
        out.append(chunk)
    return tuple(out)


def outcome(chunk: ScheduledChunk, tokens: tuple[int, ...], kv_lag: int, scheduled: int) -> RowOutcome:
    """The outcome of ``chunk`` (as it ran, drafts filled in; the host scheduled room for
    ``scheduled`` drafts) emitting ``tokens``, the drafter's KV lag after its passes ``kv_lag``:
    one more when every draft was kept (its last draft was never fed to the drafter), as the
    synchronous step records it."""
    drafts = chunk.draft_token_ids
    context = chunk.draft_context
    before = () if context is None else context.lagging_ids
    kept = len(tokens) - 1
    known = (*before, *chunk.token_ids, *drafts[:kept]) if drafts else (*before, *chunk.token_ids)
    lag = max(kv_lag, 1) if drafts and kept == len(drafts) and chunk.num_model_drafts else kv_lag
    return RowOutcome(tokens, len(drafts), scheduled, known, lag)


def shifted(chunks: tuple[ScheduledChunk, ...], shifts: Mapping[str, int]) -> tuple[ScheduledChunk, ...]:
    """``chunks`` with each request's chunk moved back by its row's rejected drafts."""
    return tuple(c._replace(start=c.start - shifts[c.req_id]) if shifts.get(c.req_id) else c for c in chunks)


def current(chunk: ScheduledChunk, req: Request, planner: SpecPlanner) -> ScheduledChunk:
    """``chunk`` made again from ``req`` as it is now, for a synchronous drain to run: its tokens
    known, its start its request's real count, a drafter's context from the lag the engine
    recorded (it may have been scheduled with a placeholder, ahead of a rejected draft, or
    before the lag of the step before was known), and its drafts (or room for them) as the
    synchronous scheduler plans them (:meth:`SpecPlanner.speculative_chunk`: n-gram drafts proposed
    here, on the host)."""
    if chunk.token_ids[-1] >= 0 and chunk.start == req.num_computed_tokens and chunk.draft_context is None:
        return chunk
    context = chunk.draft_context is not None
    if not chunk.num_model_drafts:
        return chunk_of(req, chunk.num_tokens, chunk.sample, chunk.draft_token_ids, 0, context)
    return planner.speculative_chunk(req, chunk.num_model_drafts) or planner.decode(req)


def drafts_of(chunk: ScheduledChunk) -> int:
    """The drafts ``chunk`` was scheduled with, or room for (0: a plain chunk)."""
    return chunk.num_model_drafts or len(chunk.draft_token_ids)


def masks_of(settled: SettledMasks, rows: Sequence[int]) -> SettledMasks:
    """``settled`` (decided over a step's live rows) for the live rows ``rows`` alone, renumbered."""
    at = {j: n for n, j in enumerate(rows)}
    keep = [e for e, j in enumerate(settled.row_indices) if j in at]
    bitmask = settled.bitmask[keep] if settled.bitmask is not None and keep else None
    return SettledMasks(tuple(at[settled.row_indices[e]] for e in keep), bitmask,
                        frozenset(at[j] for j in settled.deferred if j in at))  # fmt: skip


def spec_forward(
    engine: LLMEngine, launched: Launched, previous: Future[Sampled] | None, rows: Mapping[str, SamplingRow],
    copies: Future[None] | None, issued_on_return: bool, ngram: WorkerNgram | None,
    histories: Mapping[str, list[int]],
) -> torch.Tensor:  # fmt: skip
    """On the worker: step N+1's chunks rebound from N's outcomes (:func:`rebind`), the drafter's
    proposal over them (``rows``: a speculating request's sampling row, decided on the host;
    without a model drafter, ``ngram`` proposes from ``histories``, the requests' token lists),
    packed and run. The chunks as they ran go into ``launched.ran``; ``launched.issued`` is set
    once the pass is issued (:func:`~inflight.runtime.core.async_launched.issued_on_return`)."""
    try:
        if copies is not None:
            copies.result()  # the host tier's copies before this step succeeded
        outcomes = None if previous is None else outcomes_of(previous.result())
        chunks = rebind(launched.chunks, outcomes, engine.config.max_model_len or 0)
        drafter = engine.drafter or ngram
        assert drafter is not None  # pipelines_speculation
        if ngram is not None:  # each request's outcome of step N, by the placeholder it was scheduled with
            awaited = [c for c in launched.chunks if c.token_ids[-1] < 0] if outcomes is not None else []
            ngram.bind(histories, {c.req_id: outcomes[-1 - c.token_ids[-1]] for c in awaited})  # type: ignore[index]
        proposal = drafter.propose(chunks, rows.__getitem__)
        batch = engine.runner.prepare(proposal.chunks)
        if [c.req_id for c in batch.sampled_chunks] != [c.req_id for c in launched.sampled_chunks]:
            raise RuntimeError("the speculating path packed its sampled rows in another order than the host's")
        launched.ran, launched.draft_probs = batch.sampled_chunks, proposal.draft_probs
        if not issued_on_return:
            launched.issued.set()
        logits = engine.runner.execute(batch)
        launched.kv_lags.update(drafter.take_kv_lags())
        return logits
    finally:
        launched.issued.set()


def verify_job(
    engine: LLMEngine, launched: Launched, rows: list[SamplingRow], settled: SettledMasks,
    make_sampled: Callable[[PendingSample, tuple[int, ...], torch.Tensor, tuple[RowOutcome, ...],
                           tuple[tuple, ...]], Sampled],
) -> Sampled:  # fmt: skip
    """On the worker: the step's plain rows sampled and its speculating rows verified against
    the drafts the worker proposed (``launched.ran``), as the synchronous step does; the host
    read happens here, on the worker."""
    logits = launched.forward.result()
    ran = launched.ran
    counts = [len(c.draft_token_ids) + 1 if c.draft_token_ids else 1 for c in ran]
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    live = launched.rows
    spec = [j for j, i in enumerate(live) if ran[i].draft_token_ids]
    plain = [j for j, i in enumerate(live) if not ran[i].draft_token_ids]
    sampled = SamplerOutput([], [], frozenset())
    if plain:  # sampled as the synchronous step samples them (a speculating row draws nothing here)
        last = row_index([starts[live[j]] + counts[live[j]] - 1 for j in plain], logits.device)
        plain_rows = [rows[j] for j in plain]
        sampled = engine.sampler.sample(logits.index_select(0, last), plain_rows, masks_of(settled, plain))
    by_plain = {j: n for n, j in enumerate(plain)}
    verified = []
    if spec:
        picked = row_index([r for j in spec for r in range(starts[live[j]], starts[live[j] + 1])], logits.device)
        verified = verify_chunks(logits.index_select(0, picked), [ran[live[j]] for j in spec], [rows[j] for j in spec],
                                 [launched.draft_probs.get(ran[live[j]].req_id) for j in spec])  # fmt: skip
    by_row = dict(zip(spec, verified, strict=True))
    lags = launched.kv_lags
    outcomes = [RowOutcome((-1,))] * len(ran)
    logprobs: list[tuple] = [()] * len(ran)
    for j, i in enumerate(live):
        chunk = ran[i]
        if j in by_row:
            tokens, entries = by_row[j]
        elif by_plain[j] not in sampled.deferred:
            n = by_plain[j]
            tokens, entries = (sampled.token_ids[n],), (sampled.logprobs[n],)
        else:
            continue
        scheduled = drafts_of(launched.sampled_chunks[i])
        outcomes[i], logprobs[i] = outcome(chunk, tokens, lags.get(chunk.req_id, 0), scheduled), entries
    ids = [o.tokens[-1] for o in outcomes]
    deferred = frozenset(j for j in plain if by_plain[j] in sampled.deferred)
    output = SamplerOutput([ids[i] for i in live], [None] * len(live), deferred)
    tensor = torch.tensor(ids, dtype=torch.int64, device=logits.device)
    return make_sampled(PendingSample.ready(output, logits.device), live, tensor, tuple(outcomes), tuple(logprobs))


def resolve_speculating(engine: LLMEngine, launched: Launched, sampled: Sampled,
                        after: Launched | None) -> list[RequestOutput]:  # fmt: skip
    """The engine thread's half of reading a step of the speculating path: each row's placeholders
    replaced by what it emitted, its rejected drafts taken off its request's computed count and
    off the chunk the step after carries for it (``after``, scheduled as if they were kept), the
    drafter's KV lag and the speculation counters recorded as the synchronous step records them,
    and the full blocks of what has run registered in the prefix cache (of a speculating row only
    up to its last known token: its kept drafts are registered with the step after)."""
    outcomes = sampled.outcomes
    assert outcomes is not None
    lags = launched.kv_lags
    shifts: dict[str, int] = {}
    rows = set(sampled.rows) - set(launched.deferred)
    by_req = {c.req_id: i for i, c in enumerate(launched.sampled_chunks)}  # a request has one chunk a step
    for chunk, req in zip(launched.chunks, launched.requests, strict=True):
        if req.status is not RequestStatus.RUNNING:
            continue
        i = by_req.get(chunk.req_id)
        row = outcomes[i] if i is not None and i in rows else None
        req.draft_kv_lag = (
            row.lag if row is not None and row.known is not None else lags.get(chunk.req_id, req.draft_kv_lag)
        )
        if row is not None and row.num_drafts:
            engine.spec_stats.record(row.num_drafts, len(row.tokens) - 1)
        if row is not None and row.rejected:  # drafts rejected, or trimmed on the worker (to none, maybe)
            req.num_computed_tokens -= row.rejected
            shifts[chunk.req_id] = row.rejected
        engine.kv.cache_computed_blocks(req, chunk.start + (1 if drafts_of(chunk) else chunk.num_tokens))
    if after is not None and shifts:
        after.chunks, after.sampled_chunks = shifted(after.chunks, shifts), shifted(after.sampled_chunks, shifts)
    items: list[SampledTokens] = []
    for i in sampled.rows:
        if i not in rows:
            continue
        chunk, req = launched.sampled_chunks[i], launched.sampled_requests[i]
        drop_placeholder(req, i)
        if req.status is not RequestStatus.FINISHED:  # else aborted after its sampling started
            items.append(SampledTokens(chunk, outcomes[i].tokens, sampled.logprobs[i]))
    return engine.output_processor.process(items, [], _advanced)


def _advanced(chunk: ScheduledChunk, num_computed: int) -> None:
    """The output processor's ``advance`` for a pipelined step: its chunks advanced at launch."""
