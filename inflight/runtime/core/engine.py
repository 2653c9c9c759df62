"""LLMEngine: the step-level API (add, abort, step, stats) over scheduler, runner and sampler.

Each :meth:`LLMEngine.step` schedules one iteration, runs one forward pass over the packed
batch, samples one token for each sequence whose known tokens are all computed (or verifies a
speculating sequence's drafts: :mod:`.batch_run`), and hands the tokens to its
:class:`~inflight.runtime.core.output_processor.OutputProcessor`, which owns each request's output
state, applies the stop rules and returns a :class:`RequestOutput` delta per request that
produced a token or finished. Token ids only: the engine neither detokenizes nor looks for
stop strings; :class:`~inflight.runtime.engine_core.output_text.OutputText` does, for every
caller (the server's front end, the offline ``LLM``), and aborts a request at its stop string. Finished requests free their KV blocks in the same step, so
waiting requests board at the next one. Single-threaded: callers serialize access (the server
runs it in one thread). Which logits rows belong to whom is :mod:`inflight.runtime.worker.logit_rows`.
A pooling engine (embeddings, rerankers) steps through :mod:`.pooling_step`: one vector a prompt.

Requests are checked against the loaded model and the live config in :meth:`validate_request`
before they are queued, so no request should make a step raise. If the forward pass or the
sampler raises anyway, the step is retried request by request to find the culprits, which
finish with ``finish_reason == "error"`` (their blocks freed) while the others go on; a
forward pass that fails for every request alone raises :class:`EngineFatalError`. The engine
knows no request's output state (generator, grammar matcher, logprobs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from inflight.runtime.config import LIVE_TUNABLE_FIELDS, EngineConfig
from inflight.runtime.core.async_steps import StepPipeline
from inflight.runtime.core.batch_run import run_batch
from inflight.runtime.core.block_pool import KVBlockPool
from inflight.runtime.core.engine_batch_queue import BatchQueue
from inflight.runtime.core.engine_lora import LoRAMethods
from inflight.runtime.core.engine_stats import engine_stats
from inflight.runtime.core.engine_types import EngineRequest, EngineSummary
from inflight.runtime.core.host_tier import build_host_tier
from inflight.runtime.core.input_checks import check_cache_salt, check_request, check_token_budget
from inflight.runtime.core.kv_groups import GroupedKVCacheManager
from inflight.runtime.core.kv_manager import KVCacheManager, release_window
from inflight.runtime.core.mixed_pooling import check_pooling, run_mixed
from inflight.runtime.core.output_processor import OutputProcessor, SampledTokens
from inflight.runtime.core.parked import ParkedRequests
from inflight.runtime.core.pooling_step import pooling_engine
from inflight.runtime.core.prefill_backlog import PrefillBacklog
from inflight.runtime.core.request import Request
from inflight.runtime.core.sched_output import ScheduledChunk, SchedulerOutput
from inflight.runtime.core.scheduler import Scheduler
from inflight.runtime.core.spec_pipeline import pipelined_params
from inflight.runtime.core.state_pool import StatePool, hybrid_config
from inflight.runtime.core.step_failures import run_batch_or_each
from inflight.runtime.core.tenant_stats import parse_metrics_tenants
from inflight.runtime.kv_events.stream import open_kv_event_stream
from inflight.runtime.lora.types import LoRARef
from inflight.runtime.multimodal.inputs import MultimodalInputs, check_mm_inputs
from inflight.runtime.outputs import (
    EngineStats,
    RequestOutput,
    RequestRejectedError,
)
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.spec_decode.draft_proposer import DraftProposer, load_runners
from inflight.runtime.spec_decode.grammar import plain_when_grammar_busy
from inflight.runtime.spec_decode.speculative import SpecStats
from inflight.runtime.structured.manager import RequestMatcher, StructuredOutputManager
from inflight.runtime.tokenizer import encode_prompt, eos_token_ids, load_tokenizer
from inflight.runtime.worker.encoder_runner import EncoderRunner, is_encoder_dir
from inflight.runtime.worker.graph_backend import GraphBackend
from inflight.runtime.worker.model_runner import ModelRunner
from inflight.runtime.worker.sampler import Sampler
from inflight.runtime.worker.sim_device import SimRunner

logger = logging.getLogger("inflight.engine")


class LLMEngine(LoRAMethods):
    """See module docstring. Build with :meth:`from_model_dir`."""

    def __init__(self, runner: ModelRunner | SimRunner | EncoderRunner, tokenizer: Any, config: EngineConfig,
                 drafter: DraftProposer | None = None) -> None:
        self.runner = runner
        self.drafter = drafter  # draft-model speculation: its proposer (runner and KV cache)
        self.tokenizer = tokenizer
        self.max_model_len = runner.max_model_len
        self.pooling, config = pooling_engine(runner, config)  # None: a generate engine
        config = hybrid_config(runner.spec, config)  # a hybrid model: prefix caching off (core/state_pool.py)
        self.config = config.replace(max_model_len=self.max_model_len, num_kv_blocks=runner.num_kv_blocks)
        check_token_budget(self.config)
        self.eos_token_ids = eos_token_ids(runner.hf_config, tokenizer, runner.model_dir)
        groups = getattr(runner, "kv_groups", None)  # per-group KV tables (worker/kv_layout.py), else None
        # with groups, num_kv_blocks is per group: the pool holds every group's blocks (core/kv_groups.py)
        self.pool = KVBlockPool(runner.num_kv_blocks * (groups.num_groups if groups else 1), config.enable_prefix_caching)
        window = release_window(runner.spec, *([drafter.spec] if drafter else []))  # a draft model reads the same blocks
        host = build_host_tier(config, runner, [drafter.runner] if drafter else [], window, self.pooling is not None)
        self.host_kv = host[1] if host else None  # the host tier's bytes and copies (kv_offloading_size)
        states = StatePool(runner.num_state_slots, runner.state_slots) if getattr(runner, "num_state_slots", 0) else None
        self.kv = (GroupedKVCacheManager(self.pool, config.block_size, groups.windows, states) if groups else
                   KVCacheManager(self.pool, config.block_size, window, host[0] if host else None, states))
        self.scheduler = Scheduler(self.config, self.kv)
        self.prefill = PrefillBacklog()  # the TTFT backlog and prefill rate the autoscaler reads
        self.structured = StructuredOutputManager(tokenizer, runner.spec.vocab_size, self.eos_token_ids)
        self.sampler = runner.new_sampler() if isinstance(runner, SimRunner) else Sampler(runner.device)
        self.output_processor = OutputProcessor(
            self.eos_token_ids, self.max_model_len, self.prefill.remover(self.scheduler.remove),
            count_tenants=config.scheduler_policy == "fair", metrics_tenants=parse_metrics_tenants(config.metrics_tenants),
        )
        self._arrivals = 0
        self._num_tokens_last_step = 0
        self._num_steps = 0
        self._spec = SpecStats()  # read through spec_stats
        self.parked = ParkedRequests(self.output_processor, self.sampler.masks, runner.spec.vocab_size)
        self.pipeline = (StepPipeline(self) if config.async_scheduling_on and self.pooling is None
                         else BatchQueue(self) if config.pipeline_parallel_size > 1 else None)  # fmt: skip
        self.lora = self._new_lora_registry(runner, config)  # adapters (core/engine_lora.py); None: off
        self.kv_events = open_kv_event_stream(config.kv_events_config, config.block_size)  # last: it opens sockets
        self.pool.events = self.kv_events.collector if self.kv_events is not None else None

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, config: EngineConfig | None = None, progress: Callable[[str], None] | None = None,
        graph_backend: GraphBackend | None = None, tokenizer: Any = None,
    ) -> LLMEngine:
        """``graph_backend``: capture decode graphs with it (tests use the CPU stand-in); by
        default CUDA graphs on CUDA unless ``config.enforce_eager``. ``tokenizer``: the
        directory's, already loaded (else loaded here)."""
        config = config or EngineConfig()
        torch.manual_seed(config.seed)
        if progress:
            progress(f"loading model from {model_dir}")
        workers = None
        world = config.tensor_parallel_size * config.pipeline_parallel_size  # pipeline stages: issue 54
        if world > 1:
            from inflight.runtime.distributed.launcher import WorkerGroup

            if progress:
                progress(f"starting {world - 1} worker(s) (tensor x pipeline parallel "
                         f"{config.tensor_parallel_size} x {config.pipeline_parallel_size})")
            workers = WorkerGroup.start(model_dir, config)
        try:
            if config.device == "sim":  # validated: no tensor parallelism, no speculation
                runner, drafter = SimRunner(model_dir, config, progress), None
            elif is_encoder_dir(model_dir):  # a BERT encoder: the pooling runner's own
                runner, drafter = EncoderRunner(model_dir, config, progress), None
            else:
                runner, drafter = load_runners(model_dir, config, progress, workers.tp if workers else None, workers,
                                               graph_backend)  # fmt: skip
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
            engine = cls(runner, tokenizer, config, drafter)
        except BaseException:
            if workers is not None:
                workers.close()
            raise
        if progress:
            progress("model loaded")
        return engine

    def close(self) -> None:
        """Release what outlives the Python objects (tensor-parallel worker processes, mask threads)."""
        if self.pipeline is not None:
            self.pipeline.close()
        self.sampler.masks.close()
        self.runner.close()
        if self.drafter is not None:
            self.drafter.close()
        if self.kv_events is not None:
            self.kv_events.close()

    # -- requests ---------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`RequestRejectedError` for a request that can never run (no state change)."""
        check_request(prompt_token_ids, params, self.config, self.runner.spec.vocab_size)
        check_pooling(self, params)  # embeddings on a generate model: core/mixed_pooling.py

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, arrival_time: float | None = None, tenant: str = "",
        cache_salt: str | None = None, lora_name: str | None = None, mm_inputs: MultimodalInputs | None = None,
    ) -> None:
        """Queue one request. ``cache_salt`` (vLLM's): only requests with the same salt share
        prefix-cache blocks (see :mod:`inflight.runtime.core.block_pool`). ``lora_name``: a loaded
        LoRA adapter (``UnknownLoRA`` if none of that name is)."""
        if req_id in self.output_processor:
            raise RequestRejectedError(f"request id {req_id!r} is already in use", "invalid_request")
        self.validate_request(prompt_token_ids, params)
        check_cache_salt(cache_salt)
        if mm_inputs is not None:  # images: a vision-language model's only, and fitting this prompt
            check_mm_inputs(prompt_token_ids, mm_inputs, getattr(self.runner, "vision", None) is not None)
        lora = self.lora_ref(lora_name)
        self.scheduler.check_admission(1, tenant)
        self._add(req_id, prompt_token_ids, params, priority, arrival_time, tenant, cache_salt, lora, mm_inputs)

    def add_requests(self, requests: Sequence[EngineRequest]) -> None:
        """Add every request or none: on a rejection, abort the ones already added and re-raise.

        The whole group is admitted or refused (``QueueFullError``) together.
        """
        self.scheduler.check_admission(len(requests), requests[0].tenant if requests else "")
        added: list[str] = []
        try:
            for r in requests:
                self.add_request(r.req_id, r.prompt_token_ids, r.params, priority=r.priority,
                                 arrival_time=r.arrival_time, tenant=r.tenant, cache_salt=r.cache_salt,
                                 lora_name=r.lora_name, mm_inputs=r.mm_inputs)
                added.append(r.req_id)
        except BaseException:
            for req_id in added:
                self.abort_request(req_id)
            raise

    def _add(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int, arrival_time: float | None, tenant: str = "", cache_salt: str | None = None,
        lora: LoRARef | None = None, mm_inputs: MultimodalInputs | None = None,
    ) -> None:
        if self.scheduler.fair is not None:  # a stranger beyond the tenant bound shares the overflow
            tenant = self.scheduler.fair.resolve(tenant)
        req = Request(req_id, prompt_token_ids, params, priority, arrival_time, self._arrivals, tenant, cache_salt,
                      lora, mm_inputs)
        self._arrivals += 1
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.runner.device)
            seed = params.seed if params.seed is not None else hash((self.config.seed, req.arrival_seq))
            generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        matcher: RequestMatcher | None = None
        if params.structured is not None:
            try:  # compiled already (the server compiles before adding); else compiles here
                matcher = self.structured.new_matcher(params.structured)
            except ValueError as exc:
                raise RequestRejectedError(str(exc), "invalid_request", "response_format") from None
        pipeline = self.pipeline
        req.spec_pipelined = (isinstance(pipeline, StepPipeline) and pipeline.pipelines_speculation
                              and pipelined_params(params))  # fmt: skip
        self.output_processor.add(req, generator, matcher)
        self.scheduler.add(req)
        self.prefill.added(req)

    def abort_request(self, req_id: str) -> RequestOutput | None:
        self.parked.discard(req_id)
        return self.output_processor.finish(req_id, "abort")

    def has_unfinished_requests(self) -> bool:
        """True while requests are in flight, or when a dead tensor-parallel worker awaits
        the next :meth:`step` to raise ``EngineFatalError``."""
        workers = self.runner.workers
        if self.pipeline is not None and self.pipeline.busy:
            return True
        return self.scheduler.has_unfinished() or (workers is not None and workers.failure is not None)

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the batch (forward + sample), process the tokens.

        A row whose grammar mask is late gets no token: its request is parked (it computed
        all but its last position, which is recomputed once the mask is ready). Under async
        scheduling the outputs are the previous step's (:mod:`inflight.runtime.core.async_steps`)."""
        outputs = self._step()
        if self.kv_events is not None:
            self.kv_events.flush()  # the blocks this step stored and evicted, to the router
        self.prefill.stepped(time.monotonic())  # the prompt tokens it computed, the drain rate
        return outputs

    def _step(self) -> list[RequestOutput]:
        self.runner.check_health()
        if self.pipeline is not None:
            return self.pipeline.step()
        if self.pooling is not None:
            return self.pooling.step(self)
        settled = self.parked.settle()
        sched = self.schedule()
        if sched.kv_copies is not None:  # the host tier's copies, before the forward (worker/kv_copies.py)
            self.host_kv.run(sched.kv_copies)  # type: ignore[union-attr]
        if sched.is_empty:
            if not settled:
                self.parked.wait()  # only parked requests are left: wait for a mask, briefly
            return settled
        return settled + run_mixed(self, sched.chunks)  # pooled prompts pooled (core/mixed_pooling.py)

    def run_scheduled(self, chunks: tuple[ScheduledChunk, ...]) -> list[RequestOutput]:
        """Run scheduled chunks now and process their tokens (the synchronous step's body)."""
        ran, failed, sampled = self._forward_and_sample(chunks)
        deferred = {id(s.chunk) for s in sampled if not s.token_ids}
        for chunk in ran:
            if chunk.draft_token_ids or chunk.num_model_drafts:  # speculating: advances once its tokens are in
                continue
            if id(chunk) in deferred:
                self.advance(chunk, chunk.num_tokens - 1)
                self.parked.park(self.scheduler.requests[chunk.req_id], self.output_processor.matcher_of(chunk.req_id))
            else:
                self.advance(chunk, chunk.num_tokens)
        if deferred:
            sampled = [s for s in sampled if s.token_ids]
        outputs = self.output_processor.process(sampled, [c.req_id for c in failed], self.advance)
        self.parked.park_slow_grammars(s.chunk.req_id for s in sampled)
        return outputs

    def schedule(self) -> SchedulerOutput:
        """The step's batch (a busy grammar's chunk without drafts), the step counted, times stamped."""
        sched = self.scheduler.schedule()
        if self.scheduler.spec is not None and self.output_processor.num_matchers:  # else no grammar speculates
            sched = plain_when_grammar_busy(sched, self.output_processor.matcher_of)
        self._num_steps += 1
        self._num_tokens_last_step = sched.num_batched_tokens
        self.prefill.scheduled(sched.preempted, sched.admitted)
        now = time.monotonic()
        for req in sched.admitted:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        return sched

    def _forward_and_sample(
        self, chunks: tuple[ScheduledChunk, ...]
    ) -> tuple[tuple[ScheduledChunk, ...], list[ScheduledChunk], list[SampledTokens]]:
        """Run the batch: (chunks that ran, chunks that made it fail, sampled tokens)."""
        return run_batch_or_each(chunks, self._run_batch, "engine step")

    def _run_batch(self, chunks: tuple[ScheduledChunk, ...]) -> list[SampledTokens]:
        return run_batch(self, chunks)  # the device half (core/batch_run.py)

    def advance(self, chunk: ScheduledChunk, num_computed: int) -> None:
        """``chunk`` computed ``num_computed`` more positions: count them, cache full blocks."""
        req = self.scheduler.requests[chunk.req_id]
        req.num_computed_tokens += num_computed
        self.kv.cache_computed_blocks(req)
        if self.kv.sliding_window is not None:  # all-windowed models: blocks no query reads again
            self.kv.release_out_of_window(req)

    # -- what the front end may know ----------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.runner.spec.vocab_size

    @property
    def resolved(self) -> dict[str, str]:
        """What ``auto`` turned into on this machine: device, dtype, kernel backend."""
        return self.runner.resolved

    def summary(self) -> EngineSummary:
        """The frozen view an engine-core process publishes to its front end."""
        return EngineSummary(self.config, self.vocab_size, tuple(self.eos_token_ids), self.resolved)

    # -- stats and live config ----------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def num_tokens_last_step(self) -> int:
        return self._num_tokens_last_step

    @property
    def spec_stats(self) -> SpecStats:
        """The speculation counters (read-only by convention: the step records into them)."""
        return self._spec

    def stats(self) -> EngineStats:
        return engine_stats(self)  # LoRA adapters included

    def update_config(self, **changes: Any) -> EngineConfig:
        """Change live-tunable knobs (``LIVE_TUNABLE_FIELDS``) without a restart."""
        bad = sorted(set(changes) - set(LIVE_TUNABLE_FIELDS))
        if bad:
            raise ValueError(
                f"cannot change {', '.join(bad)} on a running engine; live-tunable: {', '.join(LIVE_TUNABLE_FIELDS)}"
            )
        config = self.config.replace(**changes)
        check_token_budget(config)
        self.config = config
        self.scheduler.config = self.config
        return self.config

    def warmup(self) -> None:
        """Run one tiny request through every stage so the first real one pays no start-up cost."""
        req_id = "__warmup__"
        self._add(req_id, self.encode_prompt("warm up"), SamplingParams(max_tokens=2, temperature=0.0), 0, None)
        while req_id in self.output_processor or self.has_unfinished_requests():  # async: the step after too
            self.step()
        self.pool.reset_prefix_cache()
        self.kv.prefix_cache_queries = self.kv.prefix_cache_hits = 0
        self._num_steps = 0
        self.output_processor.reset_counts()
        self.prefill.reset_counts()
