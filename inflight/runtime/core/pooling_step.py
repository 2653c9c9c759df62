"""The pooling engine's step: prompt chunks through the same scheduler, one vector per prompt.

A pooling engine (``EngineConfig.runner`` resolved to ``pooling``: an embedding model or a
sequence classifier) takes every request as a prompt to pool. Requests are scheduled exactly as
prompts of generation requests are (the token budget, ``max_num_sequences``, chunked context,
KV blocks, preemption); each step's chunks run through
:func:`~inflight.runtime.worker.pooling_runner.chunk_parts`, and a request whose prompt is
computed by the step finishes in it (``stop``) with its pooled vector as little-endian float32
bytes (``RequestOutput.pooled``), its KV blocks freed there: no decode, no sampling. A chunked
prompt's parts are added up on the request (``Request.pooled_part``: the running sum for MEAN,
the first row for CLS), restarting when a chunk starts at position 0 (a preempted request
recomputes from there). MEAN and CLS need every prompt position computed, so the engine turns
prefix caching off for them (:func:`needs_prefix_caching_off`); LAST keeps it. A BERT encoder
(:class:`~inflight.runtime.worker.encoder_runner.EncoderRunner`) reads each prompt whole: chunked
context and prefix caching are off for it, and its runner pools the chunks itself. A step that raises
is retried chunk by chunk; the chunks that fail alone finish with ``error``. Normalization and
Matryoshka truncation are the front end's (``server/pooling_api``).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.request import Request
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.core.step_failures import run_batch_or_each
from inflight.runtime.model.pooling import PoolerConfig, resolve_pooler, resolve_runner
from inflight.runtime.outputs import RequestOutput
from inflight.runtime.worker.encoder_runner import EncoderRunner
from inflight.runtime.worker.model_runner import ModelRunner
from inflight.runtime.worker.pooling_runner import chunk_parts

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

logger = logging.getLogger("inflight.engine")


def needs_prefix_caching_off(pooler: PoolerConfig) -> bool:
    """Whether this pooling reads every prompt position (a cached prefix is never computed)."""
    return pooler.pooling_type != "LAST"


class PoolingStep:
    """See module docstring. One per pooling engine; holds no request state of its own."""

    def __init__(self, pooler: PoolerConfig) -> None:
        self.pooler = pooler

    def step(self, engine: LLMEngine) -> list[RequestOutput]:
        sched = engine.schedule()
        if sched.is_empty:
            return []
        return self.run_chunks(engine, sched.chunks)

    def run_chunks(self, engine: LLMEngine, chunks: tuple[ScheduledChunk, ...]) -> list[RequestOutput]:
        """Pool scheduled prompt chunks and advance them; a prompt computed finishes with its vector."""
        ran, failed, parts = self._run(engine, chunks)
        outputs = [out for c in failed if (out := engine.output_processor.finish(c.req_id, "error")) is not None]
        for chunk, part in zip(ran, parts, strict=True):
            req = engine.scheduler.requests[chunk.req_id]
            first = req.num_computed_tokens == 0
            engine.advance(chunk, chunk.num_tokens)
            if first or self.pooler.pooling_type == "LAST" or req.pooled_part is None:
                req.pooled_part = part
            elif self.pooler.pooling_type == "MEAN":
                req.pooled_part = req.pooled_part + part  # type: ignore[operator]
            if chunk.sample:  # the prompt is computed: the request's answer
                outputs.append(engine.output_processor.finish_pooled(req, self._vector_bytes(req)))
        return outputs

    def _vector_bytes(self, req: Request) -> bytes:
        part = req.pooled_part
        if not isinstance(part, torch.Tensor):
            raise RuntimeError("a pooled request finished without its pooled part")
        vector = part / req.num_prompt_tokens if self.pooler.pooling_type == "MEAN" else part
        req.pooled_part = None
        return vector.numpy().astype("<f4", copy=False).tobytes()

    def _run(
        self, engine: LLMEngine, chunks: tuple[ScheduledChunk, ...]
    ) -> tuple[tuple[ScheduledChunk, ...], list[ScheduledChunk], list[torch.Tensor]]:
        """(the chunks that ran, the chunks that failed alone, each chunk's part)."""
        kind, runner = self.pooler.pooling_type, engine.runner
        run = runner.pool_chunks if isinstance(runner, EncoderRunner) else functools.partial(chunk_parts, runner)
        return run_batch_or_each(chunks, lambda batch: list(run(batch, kind)), "pooling step")  # type: ignore[arg-type]


def pooling_engine(runner: object, config: EngineConfig) -> tuple[PoolingStep | None, EngineConfig]:
    """The pooling step for ``runner``'s model when ``config.runner`` resolves to pooling (else
    None), and ``config`` with its runner resolved, the resolved pooling in ``pooler_config``, and
    prefix caching off where the pooling reads every prompt position (logged)."""
    spec = runner.spec  # type: ignore[attr-defined]
    kind = resolve_runner(config.runner, spec.head)
    if kind == "generate":
        if config.pooler_config is not None:
            raise ValueError("pooler_config is the pooling runner's, and this checkpoint has an LM head (served "
                             "as a generator by default); add --runner pooling to serve it as an embedding model.")
        return None, config.replace(runner="generate")
    if not isinstance(runner, (ModelRunner, EncoderRunner)):
        raise ValueError("the pooling runner needs a loaded model (not device sim)")
    encoder = isinstance(runner, EncoderRunner)  # whole prompts, no KV: no chunks, nothing to cache
    pooler = resolve_pooler(runner.model_dir, runner.hf_config, spec.head, config.pooler_config,
                            "CLS" if encoder else "LAST")
    caching = config.enable_prefix_caching and not needs_prefix_caching_off(pooler) and not encoder
    if encoder:
        logger.info("chunked context and prefix caching are off: a BERT encoder reads each prompt whole")
    elif config.enable_prefix_caching and not caching:
        logger.info("prefix caching is off: %s pooling reads every prompt position", pooler.pooling_type)
    logger.info("pooling runner: %s", pooler.to_json())
    # replace() runs EngineConfig's checks again: what the pooling runner cannot run with is refused
    return PoolingStep(pooler), config.replace(runner="pooling", pooler_config=pooler.to_json(),
                                               enable_prefix_caching=caching,
                                               enable_chunked_context=config.enable_chunked_context and not encoder)
