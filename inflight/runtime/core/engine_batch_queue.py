"""Several steps in flight across pipeline stages: vLLM's batch queue (issue 54).

With ``pipeline_parallel_size`` P > 1 a synchronous step keeps only one stage busy at a time.
Here the engine keeps up to ``max_in_flight`` (P by default) scheduled steps outstanding: each
:meth:`BatchQueue.step` schedules and *launches* a new step while the queue has room (rank 0
broadcasts it, runs the first stage and posts its send and the receive of the logits, without
waiting: :func:`inflight.runtime.worker.pipeline_step.launch`), and otherwise, or when nothing
more can be scheduled, waits for the oldest step's logits, samples them and processes the
tokens, which are that call's outputs.

**Never schedule what is in flight.** A launched step's requests are marked ``in_flight``; the
scheduler skips them and never picks them to preempt (:mod:`.scheduler`), so a request is in
at most one step at a time, and its next token is scheduled only once its last one is sampled
(which the next step's input needs). Steps go through every stage in launch order, so a KV
block freed by an abort while its step is in flight and handed to a later step is written by
the later step after the earlier one on every stage. A request aborted while in flight has its
rows thrown away when its step comes back. Chunks advance (and their full blocks enter the
prefix cache) only when their step is back: only computed blocks are ever shared.

Sampling happens when a step comes back, in launch order, so a seeded request draws its
random numbers in the same order as in the synchronous engine, and grammar masks see every
token before. Speculative decoding, LoRA, the host tier and the fair policy are refused with
pipeline stages (``EngineConfig``). Any failure of a launched step is fatal (the ranks are out
of step): :class:`~inflight.runtime.outputs.EngineFatalError`. A host-side failure (packing a
step, sampling it) fails that step's requests with an error, and the engine goes on: unlike the
synchronous step, a launched step cannot be retried request by request. Knows nothing about processes.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inflight.runtime.core.output_processor import SampledTokens
from inflight.runtime.core.request import Request, RequestStatus
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.outputs import EngineFatalError, RequestOutput
from inflight.runtime.worker.batch_inputs import BatchInputs
from inflight.runtime.worker.logit_rows import split_logits
from inflight.runtime.worker.pipeline_step import PendingLogits, collect, launch

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

logger = logging.getLogger("inflight.engine")


@dataclass(slots=True)
class InFlight:
    """A launched step: its chunks (and their requests, as launched: an id may be reused once
    a request aborted in flight is gone), its packed batch, and its logits to come."""

    chunks: tuple[ScheduledChunk, ...]
    requests: dict[str, Request]  # req_id -> the request each chunk ran for
    batch: BatchInputs
    pending: PendingLogits


class BatchQueue:
    """Up to ``max_in_flight`` steps outstanding over the pipeline stages (see module docstring)."""

    def __init__(self, engine: LLMEngine, max_in_flight: int | None = None) -> None:
        self.engine = engine
        self.max_in_flight = max_in_flight or engine.config.pipeline_parallel_size
        self._queue: deque[InFlight] = deque()

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    @property
    def num_in_flight(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Let the steps in flight come back (their tokens dropped) before the workers stop."""
        while self._queue:
            item = self._queue.popleft()
            try:
                collect(self.engine.runner, item.pending)
            except Exception:  # noqa: BLE001 (failing anyway: the worker group is being stopped)
                logger.warning("a pipeline step in flight failed while the engine closed", exc_info=True)
                self._queue.clear()

    def step(self) -> list[RequestOutput]:
        eng = self.engine
        settled = eng.parked.settle()
        if len(self._queue) < self.max_in_flight:
            sched = eng.schedule()  # in-flight requests sit out (Request.in_flight)
            if sched.chunks:
                try:
                    batch = eng.runner.prepare(sched.chunks)
                except EngineFatalError:
                    raise
                except Exception:  # noqa: BLE001 - a request's inputs: its step's requests fail, the rest go on
                    logger.exception("preparing a pipeline step failed; failing its %d request(s)", len(sched.chunks))
                    return settled + eng.output_processor.process([], [c.req_id for c in sched.chunks], eng.advance)
                self._queue.append(self._launch(sched.chunks, batch))
                if len(self._queue) < self.max_in_flight:
                    return settled  # room for another step before waiting for the oldest
        if not self._queue:
            if not settled:
                eng.parked.wait()  # only parked requests are left: wait for a mask, briefly
            return settled
        return settled + self._finish(self._queue.popleft())

    def _launch(self, chunks: tuple[ScheduledChunk, ...], batch: BatchInputs) -> InFlight:
        runner, live = self.engine.runner, self.engine.scheduler.requests
        requests = {c.req_id: live[c.req_id] for c in chunks}
        for req in requests.values():
            req.in_flight = True
        return InFlight(chunks, requests, batch, launch(runner, batch))  # type: ignore[arg-type]

    def _finish(self, item: InFlight) -> list[RequestOutput]:
        """Sample a step that is back and process its tokens (the synchronous step's second half)."""
        eng = self.engine
        logits = collect(eng.runner, item.pending)  # type: ignore[arg-type]
        for req in item.requests.values():
            req.in_flight = False
        live = {id(c) for c in item.chunks if item.requests[c.req_id].status is RequestStatus.RUNNING}  # else aborted
        try:
            return self._sample_and_process(item, logits, live)
        except EngineFatalError:
            raise
        except Exception:  # noqa: BLE001 - host-side (sampling): the step's requests fail, the engine goes on
            logger.exception("sampling a pipeline step failed; failing its request(s)")
            failed = [c.req_id for c in item.chunks if id(c) in live and item.requests[c.req_id].status is RequestStatus.RUNNING]
            return eng.output_processor.process([], failed, eng.advance)

    def _sample_and_process(self, item: InFlight, logits: torch.Tensor, live: set[int]) -> list[RequestOutput]:
        eng = self.engine
        batch = item.batch
        split = split_logits(logits, batch.sample_counts, batch.prompt_logprob_spans)
        for chunk, first, span in split.prompt_spans:
            if id(chunk) in live:
                eng.output_processor.collect_prompt_logprobs(chunk.req_id, first, span)
        keep = [i for i, c in enumerate(batch.sampled_chunks) if id(c) in live]
        chunks = [batch.sampled_chunks[i] for i in keep]
        rows = [eng.output_processor.sampling_row(c.req_id) for c in chunks]
        masks = eng.sampler.prepare_masks(rows, eng.runner.spec.vocab_size)
        out = eng.sampler.sample(split.sampled[[split.starts[i] for i in keep]], rows, masks)
        sampled = [SampledTokens(c, (t,), (lp,)) if i not in out.deferred else SampledTokens(c, (), ())
                   for i, (c, t, lp) in enumerate(zip(chunks, out.token_ids, out.logprobs, strict=True))]  # fmt: skip
        deferred = {id(s.chunk) for s in sampled if not s.token_ids}
        for chunk in item.chunks:
            if id(chunk) not in live:
                continue
            if id(chunk) in deferred:
                eng.advance(chunk, chunk.num_tokens - 1)
                eng.parked.park(item.requests[chunk.req_id], eng.output_processor.matcher_of(chunk.req_id))
            else:
                eng.advance(chunk, chunk.num_tokens)
        sampled = [s for s in sampled if s.token_ids]
        outputs = eng.output_processor.process(sampled, [], eng.advance)
        eng.parked.park_slow_grammars(s.chunk.req_id for s in sampled)
        return outputs
