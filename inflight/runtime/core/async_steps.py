"""Async scheduling: the engine thread prepares step N+1 while step N runs (``--async-scheduling``).

The synchronous step schedules, runs the forward pass and the sampling, then turns the tokens
into outputs, so the device idles while the host schedules and packs the next batch and the
host idles while the device runs. Here the device work runs on a :class:`StepWorker` thread
(one job after another, as on one CUDA stream), and each :meth:`StepPipeline.step` call does:

1. schedule step N+1 *optimistically*: step N's chunks were advanced when N was launched, and
   each request that samples in N carries a **placeholder** for its token (``-1 - row``, the
   row of N's sampled tokens), so a decode of N+1 costs one token as usual;
2. pack N+1 and submit its forward pass; on the worker, placeholders in its input ids are
   replaced from N's sampled token tensor (a gather on the device, no host sync);
3. wait for N's tokens and for the worker to issue N+1 (the device's next step goes before
   the host's long Python stretch: ``_ISSUE_WAIT_S``), put the tokens in place of the
   placeholders and process them (stop rules, grammars, finished requests free their blocks):
   these are the call's outputs;
4. register N's full blocks in the prefix cache (only what has run: never a block the step
   in flight still writes);
5. decide N+1's sampling on the host (its requests' penalties and grammar masks now see N's
   tokens), submit it, and give each request that samples a placeholder for its token.

**The one-step lag.** A request that stops at N (EOS, a stop token, its grammar's end, an
abort) has already been scheduled in N+1: its row there is computed and thrown away, and its
blocks are freed at step 3 (safe: any later step that reuses them runs after N+1 on the
worker). A request that N finishes by length is never scheduled in N+1. Requests that finish
free their slot one step later than synchronously, so a waiting request boards one step later;
tokens are the same, greedy or seeded, as the synchronous engine's.

**Grammar masks.** N+1's masks can only start once N's tokens have advanced the grammars (step
3); they fill while N+1's forward runs, and the sampler's grace is counted from N+1's launch.
A row whose mask is late (or whose grammar is slow) is decided deferred on the host, so the
next schedule already knows its request is parked.

**The host tier's copies** (``kv_offloading_size``) of step N+1 are submitted to the worker as a
job of their own right after N+1 is scheduled: they run after step N (which may still read a
block being saved, or write the thrown-away row of a block N+1 gets afresh) and before N+1's
forward, which checks that they succeeded; a synchronous run waits for them first.

**What runs synchronously.** Steps with a chunk that wants prompt logprobs drain the pipeline
(N is finished first, then the step runs in place). If a step fails on the worker, the step
launched after it is rolled back and the failed one is run again synchronously, where the
engine's retry finds the request that made it fail (:meth:`LLMEngine.run_scheduled`); an
``EngineFatalError`` (a tensor-parallel rank died or left a step half-way) is raised as it is.
Under tensor parallelism rank 0's worker thread broadcasts each step to the other ranks as the
engine thread would (the input ids fixed up first), so every collective runs on that one thread.

**Speculative decoding.** Requests without penalties, ``min_tokens`` or a grammar speculate in
pipelined steps with every method (:mod:`.spec_pipeline`): N+1 is scheduled as if N kept every
draft, its chunks are rebound to N's accepted counts, proposed (a model drafter, or n-grams from
the request's history: :mod:`.spec_ngram`) and packed on the worker once N is verified there, and
reading N takes each row's drafts not kept off its request and off N+1's chunk. The others
drain: while speculation is on for the batch (fewer than ``disable_by_batch_size`` running) and
such a request awaits the step in flight's token and may draft, :meth:`step` reads that step
first, then schedules, and the step runs as the synchronous engine runs it
(:meth:`LLMEngine.run_scheduled`), at the synchronous cost. A model drafter follows every
pipelined step on the worker, before its forward, once the step before's tokens are in
(:meth:`_forward_job`); its KV lag reaches the request when the step is read, before the prefix
cache. Knows nothing about the model or kernels.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from inflight.runtime.core.async_launched import (
    Launched,
    Sampled,
    bind_placeholder,
    drop_placeholder,
    issued_on_return,
    no_sampling_row,
    placeholder,
    requests_of,
    roll_back,
    undo,
)
from inflight.runtime.core.output_processor import SampledTokens
from inflight.runtime.core.request import Request, RequestStatus
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.core.spec_ngram import WorkerNgram
from inflight.runtime.core.spec_pipeline import (
    current,
    drafts_of,
    pipelines_speculation,
    resolve_speculating,
    sampled_in_packed_order,
    spec_forward,
    verify_job,
)
from inflight.runtime.outputs import EngineFatalError, RequestOutput
from inflight.runtime.worker.batch_inputs import BatchInputs
from inflight.runtime.worker.batched_sampling import row_index
from inflight.runtime.worker.sampler import SamplingRow
from inflight.runtime.worker.step_worker import StepWorker

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

logger = logging.getLogger("inflight.engine")

# How long the engine thread waits, once step N's tokens are in, for the worker to issue step
# N+1 before it turns N's tokens into outputs. Each torch call releases the GIL; an engine thread
# that takes it then for its long Python stretch (N's outputs, N+2's schedule) holds the worker,
# and the device's next step, for up to the interpreter's switch interval (5 ms) a call. The
# bound only guards against a worker that never gets there (its jobs before it are queued).
_ISSUE_WAIT_S = 1.0


class StepPipeline:
    """Async scheduling for one engine (see module docstring)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.worker = StepWorker(engine.runner.device)
        self.inflight: Launched | None = None
        self._copies: Future[None] | None = None  # the host tier's copies last submitted
        self._issued_on_return = issued_on_return(engine.runner.device)  # see _forward_job
        self.num_drains = 0  # steps run synchronously (prompt logprobs, speculation, recovery)
        self.num_spec_waits = 0  # steps in flight waited for before scheduling (speculation may follow)
        self.pipelines_speculation = pipelines_speculation(engine)  # drafts in pipelined steps (spec_pipeline.py)
        self.ngram = WorkerNgram.of(engine) if self.pipelines_speculation else None  # n-grams on the worker
        self.num_spec_pipelined = 0  # steps with drafts launched while the step before was in flight, or could be

    @property
    def busy(self) -> bool:
        return self.inflight is not None

    def close(self) -> None:
        self.worker.close()

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        eng = self.engine
        settled = eng.parked.settle()
        if self.inflight is not None and self._waits_for_speculation():
            previous, self.inflight = self.inflight, None
            self.num_spec_waits += 1
            outputs, ok = self._resolve(previous, None)
            if not ok:  # it failed and ran again synchronously: schedule anew next step
                return settled + outputs
            settled = settled + outputs
        sched = eng.schedule()  # optimistic: the step in flight's tokens are placeholders
        if sched.kv_copies is not None:  # on the worker, after the step in flight, before this one
            self._copies = self.worker.submit(eng.host_kv.run, sched.kv_copies)  # type: ignore[union-attr]
        previous = self.inflight
        requests = requests_of(sched, eng.scheduler.requests)
        if sched.chunks and not self._pipelinable(sched.chunks, requests):
            self.inflight = None
            outputs, ok = self._resolve(previous, None) if previous else ([], True)
            if not ok:  # the step before failed and ran again: this one is scheduled anew
                return settled + outputs
            return settled + outputs + self._run_sync(sched.chunks, requests)
        launched = self._launch(sched.chunks, requests) if sched.chunks else None
        outputs: list[RequestOutput] = []
        if previous is not None:
            outputs, ok = self._resolve(previous, launched)
            if not ok:
                launched = None  # rolled back: its requests are scheduled again next step
        if launched is not None:
            try:
                self._start_sampling(launched)
            except Exception:  # noqa: BLE001 - the synchronous retry isolates the cause
                self.inflight = None
                return settled + outputs + self._run_now(launched)
        self.inflight = launched
        if previous is None and launched is None and not settled:
            eng.parked.wait()  # only parked requests are left: wait for a mask, briefly
        return settled + outputs

    def _waits_for_speculation(self) -> bool:
        """Whether the step in flight must be read before the next is scheduled: speculation is on
        for this batch and a running request awaits its token (it drafts once the token is known),
        unless it drafts in pipelined steps and the step in flight ran the speculating path
        (:mod:`.spec_pipeline`)."""
        scheduler, inflight = self.engine.scheduler, self.inflight
        if not scheduler.speculates():
            return False
        path = inflight is not None and inflight.spec_path
        return any(r.token_ids[-1] < 0 and scheduler.may_draft(r) and not (path and r.spec_pipelined)
                   for r in scheduler.running)  # fmt: skip

    def _pipelinable(self, chunks: tuple[ScheduledChunk, ...], requests: tuple[Request, ...]) -> bool:
        """Whether ``chunks`` can run while the step before is in flight (no prompt logprobs,
        no drafts but those of a request that drafts in pipelined steps)."""
        for chunk, req in zip(chunks, requests, strict=True):
            if (chunk.draft_token_ids or chunk.num_model_drafts) and not req.spec_pipelined:
                return False
            facts = chunk.facts
            if facts.prompt_logprobs is not None and chunk.start < facts.num_prompt_tokens - 1:
                return False
        return True

    # -- launching ----------------------------------------------------------------------
    def _launch(self, chunks: tuple[ScheduledChunk, ...], requests: tuple[Request, ...]) -> Launched:
        """Pack ``chunks`` (chunk i is ``requests[i]``'s), submit their forward pass and advance
        them (optimistically)."""
        eng = self.engine
        speculating = any(map(drafts_of, chunks))
        if speculating or (self.inflight is not None and self.inflight.speculating):
            return self._launch_speculating(chunks, requests, speculating)
        batch = eng.runner.prepare(chunks)
        sampled_chunks = batch.sampled_chunks
        if sampled_chunks == chunks:  # every row samples, in the scheduler's order (a decode step)
            sampled = requests
        else:
            live = eng.scheduler.requests
            sampled = tuple([live[c.req_id] for c in sampled_chunks])
        previous = self._previous(chunks)
        lags: dict[str, int] = {}  # a model drafter's KV lags, filled on the worker
        mirrored = chunks if eng.drafter is not None else None
        issued = threading.Event()
        forward = self.worker.submit(self._forward_job, batch, previous, self._copies, mirrored, lags, issued)
        for chunk, req in zip(chunks, requests, strict=True):
            req.num_computed_tokens += chunk.num_tokens
        return Launched(chunks, requests, batch.sampled_chunks, sampled, forward, time.monotonic(),
                        kv_lags=lags, issued=issued)  # fmt: skip

    def _previous(self, chunks: tuple[ScheduledChunk, ...]) -> Future[Sampled] | None:
        """The step in flight's sampling, if ``chunks`` read a placeholder for one of its tokens."""
        waits = any(c.token_ids[-1] < 0 for c in chunks)  # a placeholder can only be a request's last token
        previous = self.inflight.sample if waits and self.inflight is not None else None
        if waits and previous is None:
            raise RuntimeError("a scheduled chunk reads a placeholder token with no step in flight")
        return previous

    def _launch_speculating(self, chunks: tuple[ScheduledChunk, ...], requests: tuple[Request, ...],
                            speculating: bool) -> Launched:  # fmt: skip
        """:meth:`_launch` through the speculating path (:mod:`.spec_pipeline`): the chunks are
        rebound, proposed and packed on the worker, after the step before is verified there."""
        eng = self.engine
        sampled_chunks = sampled_in_packed_order(chunks)
        sampled = tuple([eng.scheduler.requests[c.req_id] for c in sampled_chunks])
        rows = {c.req_id: eng.output_processor.sampling_row(c.req_id) for c in chunks if c.num_model_drafts}
        launched = Launched(chunks, requests, sampled_chunks, sampled, Future(), time.monotonic(), spec_path=True,
                            speculating=speculating)  # fmt: skip
        self.num_spec_pipelined += speculating
        histories = self.ngram.histories(chunks, requests) if self.ngram is not None else {}
        launched.forward = self.worker.submit(spec_forward, eng, launched, self._previous(chunks), rows, self._copies,
                                              self._issued_on_return, self.ngram, histories)  # fmt: skip
        for chunk, req in zip(chunks, requests, strict=True):
            req.num_computed_tokens += chunk.num_tokens  # optimistic: every draft kept (spec_pipeline.py)
        return launched

    def _forward_job(self, batch: BatchInputs, previous: Future[Sampled] | None, copies: Future[None] | None,
                     mirrored: tuple[ScheduledChunk, ...] | None, lags: dict[str, int],
                     issued: threading.Event) -> torch.Tensor:  # fmt: skip
        """On the worker: put the previous step's tokens in place of placeholders, run the pass
        (after checking that the host tier's copies before it succeeded: they ran already).
        ``mirrored``: the step's chunks, for a model drafter to run over first (none drafts in
        an async step); its KV lags go into ``lags``. ``issued`` is set once the pass is issued
        (:func:`issued_on_return`), or has failed (see :meth:`_resolve`)."""
        try:
            if copies is not None:
                copies.result()
            if previous is not None:
                ids = batch.input_ids  # [num_tokens] int64
                prev = previous.result().token_ids
                ids.copy_(torch.where(ids < 0, prev[(-1 - ids).clamp(min=0)], ids))
            if batch.prompt_logprob_spans or any(n != 1 for n in batch.sample_counts):
                raise RuntimeError("an async step has prompt logprobs or speculation")
            if not self._issued_on_return:
                issued.set()
            drafter = self.engine.drafter
            if mirrored is None or drafter is None:
                return self.engine.runner.execute(batch)
            if previous is not None and any(c.token_ids[-1] < 0 for c in mirrored):  # the drafter reads host ids
                tokens = previous.result().token_ids.tolist()  # waits for the step before's sampling
                mirrored = tuple([bind_placeholder(c, tokens) for c in mirrored])
            drafter.propose(mirrored, no_sampling_row)
            logits = self.engine.runner.execute(batch)
            lags.update(drafter.take_kv_lags())
            return logits
        finally:
            issued.set()

    def _start_sampling(self, launched: Launched) -> None:
        """Decide the step's sampling on the host and submit it; placeholders for its tokens.
        Everything that can raise (grammar masks) runs before any request's state changes."""
        eng = self.engine
        live: list[int] = []
        slow: list[int] = []  # parked after N's token: a slow grammar advances off the step (parked.py)
        requests = launched.sampled_requests
        for i, req in enumerate(requests):
            if req.status is RequestStatus.RUNNING:  # else it ended while the step ran
                (slow if req.parked else live).append(i)
        rows = [eng.output_processor.sampling_row(requests[i].req_id) for i in live]
        pending = eng.sampler.prepare_masks(rows, eng.vocab_size)
        if pending is not None:  # the grace counts from the forward pass's launch
            pending = dataclasses.replace(pending, started=launched.launched_at)
        settled = eng.sampler.settle_masks(rows, pending, eng.vocab_size)
        deferred = tuple(live[j] for j in sorted(settled.deferred))
        for i in slow:
            requests[i].num_computed_tokens -= 1  # recomputed once unparked
        for i in deferred:
            req = requests[i]
            req.num_computed_tokens -= 1  # its last position is recomputed once the mask is ready
            eng.parked.park(req, eng.output_processor.matcher_of(req.req_id))
        launched.rows, launched.deferred = tuple(live), deferred
        if launched.spec_path:
            launched.sample = self.worker.submit(verify_job, eng, launched, rows, settled, Sampled)
        else:
            launched.sample = self.worker.submit(self._sample_job, launched, rows, settled)
        chunks = launched.sampled_chunks
        for i in live:
            if i not in deferred:
                ids = requests[i].token_ids
                ids.append(placeholder(i))
                if launched.speculating and drafts_of(chunks[i]):  # one per position it computes
                    ids.extend([placeholder(i)] * (chunks[i].num_tokens - 1))  # (spec_pipeline.py)

    def _run_now(self, launched: Launched) -> list[RequestOutput]:
        """Deciding ``launched``'s sampling raised: undo it and run it synchronously, where the
        engine's retry fails only the requests that cause it."""
        logger.exception("deciding an async step's sampling failed; running it again synchronously")
        undo(launched)
        return self._run_sync(launched.chunks, launched.requests)

    def _run_sync(self, chunks: tuple[ScheduledChunk, ...], requests: tuple[Request, ...]) -> list[RequestOutput]:
        """Run the still-running ``chunks`` now, synchronously (a drain of the pipeline), each
        with its request's tokens as they are now (a placeholder it was scheduled with is resolved)."""
        self.num_drains += 1
        if self._copies is not None:
            self._copies.result()  # the host tier's copies run before any forward that may read them
        planner = self.engine.scheduler.planner
        live = tuple(current(c, r, planner) for c, r in zip(chunks, requests, strict=True)
                     if r.status is RequestStatus.RUNNING)  # fmt: skip
        return self.engine.run_scheduled(live) if live else []

    def _sample_job(self, launched: Launched, rows: list[SamplingRow], settled: object) -> Sampled:
        """On the worker: queue the sampling of the rows the host decided on. The tokens stay on
        the device for the next step's forward and their copy to the host is only started, so the
        worker launches step N+1 before anything waits for N (the engine thread waits, in
        :meth:`_resolve`)."""
        logits = launched.forward.result()
        index = row_index(launched.rows, logits.device)
        if len(launched.rows) != logits.shape[0]:
            logits = logits.index_select(0, index)
        output = self.engine.sampler.start_sample(logits, rows, settled)  # type: ignore[arg-type]
        tokens = torch.full((len(launched.sampled_chunks),), -1, dtype=torch.int64, device=logits.device)
        tokens.index_copy_(0, index, output.token_ids)
        return Sampled(output, launched.rows, tokens)

    # -- resolving ------------------------------------------------------------------------
    def _resolve(self, launched: Launched, after: Launched | None) -> tuple[list[RequestOutput], bool]:
        """Wait for ``launched``'s tokens and process them: (outputs, True); or, if it failed,
        roll back ``after`` and run ``launched`` again synchronously: (outputs, False)."""
        assert launched.sample is not None
        try:
            sampled = launched.sample.result()
            output = sampled.output.result()  # waits for the tokens' copy to the host
            if after is not None:  # the worker issues it first: see _ISSUE_WAIT_S
                after.issued.wait(_ISSUE_WAIT_S)
        except EngineFatalError:  # a tensor-parallel rank died or left a step half-way: never run again
            raise
        except Exception:
            logger.exception("an async engine step failed; running it again synchronously")
            return self._recover(launched, after), False
        eng = self.engine
        if sampled.outcomes is not None:  # the speculating path (spec_pipeline.py)
            outputs = resolve_speculating(eng, launched, sampled, after)
            eng.parked.park_slow_grammars(c.req_id for c in launched.sampled_chunks)
            return outputs, True
        deferred = set(launched.deferred)
        lags = launched.kv_lags  # a model drafter's (empty without one): before the prefix cache reads them
        for chunk, req in zip(launched.chunks, launched.requests, strict=True):
            if req.status is RequestStatus.RUNNING:  # only what has run goes in the prefix cache
                if lags:
                    req.draft_kv_lag = lags.get(chunk.req_id, req.draft_kv_lag)
                eng.kv.cache_computed_blocks(req, chunk.start + chunk.num_tokens)
        items: list[SampledTokens] = []
        for j, i in enumerate(sampled.rows):
            if i in deferred:
                continue
            chunk, req = launched.sampled_chunks[i], launched.sampled_requests[i]
            drop_placeholder(req, i)
            if req.status is not RequestStatus.FINISHED:  # else aborted after its sampling started
                items.append(SampledTokens(chunk, (output.token_ids[j],), (output.logprobs[j],)))
        outputs = eng.output_processor.process(items, [], eng.advance)
        eng.parked.park_slow_grammars(item.chunk.req_id for item in items)
        return outputs, True

    def _recover(self, failed: Launched, after: Launched | None) -> list[RequestOutput]:
        """``failed`` raised on the worker: undo ``after`` and ``failed``, then run ``failed``'s
        chunks synchronously (the engine's retry fails only the requests that cause it)."""
        if after is not None:
            undo(after)
        for i in failed.rows:
            drop_placeholder(failed.sampled_requests[i], i)
        for i in failed.deferred:
            self.engine.parked.discard(failed.sampled_chunks[i].req_id)
        roll_back(failed)
        return self._run_sync(failed.chunks, failed.requests)
