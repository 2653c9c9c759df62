"""Embeddings on a generate engine: pooled prompts scheduled beside chat requests, LAST-token pooled.

A generate (decoder) model answers /v1/embeddings too (on by default, as llama.cpp's server does
with ``--embeddings``; docs/embeddings.md): the front end marks such a request
``SamplingParams.pooling``, and the engine schedules it exactly as any prompt (the token budget,
chunked context, KV blocks, preemption, prefix caching). In a step, the pooled requests' chunks
run through the pooling path (:meth:`PoolingStep.run_chunks`: the runner's final-normed hidden
states, the prompt's last row) and the others through the normal forward and sampler: two forwards
in a step that mixes them (a first version; one packed forward is left to do). A pooled request
finishes when its prompt is computed, its blocks freed, nothing sampled. Its failures stay its
own: a pooling forward that fails for every pooled chunk alone finishes those with ``error`` and
the step's generation goes on. Refused with a clear reason (:func:`check_pooling`) where the mix
is not built: async scheduling or pipeline stages, speculative decoding, tensor parallelism, a
model with per-sequence state, device sim.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from inflight.runtime.core.pooling_step import PoolingStep
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.pooling import PoolerConfig
from inflight.runtime.outputs import EngineFatalError, RequestOutput, RequestRejectedError
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

logger = logging.getLogger("inflight.engine")

# A generate model's embedding: the last prompt token's final-normed hidden state (the front end
# normalizes it: server/pooling_api/common.py's GENERATE_POOLER).
_STEP = PoolingStep(PoolerConfig(kind="embed", pooling_type="LAST", normalize=True))


def unsupported_reason(engine: LLMEngine) -> str | None:
    """Why this generate engine cannot pool prompts (None: it can)."""
    runner = engine.runner
    if not isinstance(runner, ModelRunner):
        return "embeddings need a loaded model (not device sim)"
    if engine.pipeline is not None:
        return "embeddings on a generate model are not built with async scheduling or pipeline stages"
    if engine.scheduler.spec is not None or engine.drafter is not None:
        return "embeddings on a generate model are not built with speculative decoding"
    if runner.workers is not None:
        return "embeddings on a generate model are not built with tensor parallelism"
    if getattr(runner, "num_state_slots", 0):
        return "embeddings are not built for a model with per-sequence state (a hybrid model)"
    return None


def check_pooling(engine: LLMEngine, params: SamplingParams) -> None:
    """Refuse a pooled request this generate engine cannot run (``RequestRejectedError``)."""
    if not params.pooling or engine.pooling is not None:  # a pooling engine pools every request
        return
    reason = unsupported_reason(engine)
    if reason is not None:
        raise RequestRejectedError(reason, "invalid_request")


def run_mixed(engine: LLMEngine, chunks: tuple[ScheduledChunk, ...]) -> list[RequestOutput]:
    """Run a generate engine's scheduled chunks: pooled ones pooled, the others generated."""
    requests = engine.scheduler.requests
    pooled = tuple(c for c in chunks if requests[c.req_id].params.pooling)
    if not pooled:
        return engine.run_scheduled(chunks)
    rest = tuple(c for c in chunks if not requests[c.req_id].params.pooling)
    outputs = engine.run_scheduled(rest) if rest else []
    try:
        return outputs + _STEP.run_chunks(engine, pooled)
    except EngineFatalError:  # every pooled chunk failed alone: theirs to bear, not the generation's
        logger.exception("the pooling forward failed for each of %d pooled chunks", len(pooled))
        finish = engine.output_processor.finish
        return outputs + [out for c in pooled if (out := finish(c.req_id, "error")) is not None]
