"""LLMEngine: the step-level API (add, abort, step, stats) over scheduler, runner and sampler.

Each :meth:`LLMEngine.step` schedules one iteration, runs one forward pass over the packed
batch, samples one token for each sequence whose known tokens are all computed, applies the
stop rules, and returns a :class:`RequestOutput` delta per request that produced a token or
finished. Finished requests free their KV blocks in the same step, so waiting requests board
at the next one. Single-threaded: callers serialize access (the server runs it in one thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from inflight.runtime.block_pool import KVBlockPool
from inflight.runtime.config import LIVE_TUNABLE_FIELDS, EngineConfig
from inflight.runtime.detokenizer import IncrementalDetokenizer
from inflight.runtime.kv_manager import KVCacheManager, cdiv
from inflight.runtime.model_runner import ModelRunner
from inflight.runtime.outputs import (
    EngineStats,
    QueueFullError,
    RequestOutput,
    RequestRejectedError,
    RequestTimes,
    TokenLogprob,
)
from inflight.runtime.request import Request
from inflight.runtime.sampler import Sampler, SamplingRow
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.scheduler import ScheduledChunk, Scheduler
from inflight.runtime.tokenizer import eos_token_ids, load_tokenizer


class _Live:
    """Per-request engine-side state that is not scheduling state."""

    __slots__ = ("detok", "generator", "pending_logprobs")

    def __init__(self, detok: IncrementalDetokenizer, generator: torch.Generator | None) -> None:
        self.detok = detok
        self.generator = generator
        self.pending_logprobs: list[TokenLogprob] = []


class LLMEngine:
    """See module docstring. Build with :meth:`from_model_dir`."""

    def __init__(self, runner: ModelRunner, tokenizer: Any, config: EngineConfig) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_model_len = runner.max_model_len
        self.config = config.replace(max_model_len=self.max_model_len, num_kv_blocks=runner.num_kv_blocks)
        self.eos_token_ids = eos_token_ids(runner.hf_config, tokenizer, runner.model_dir)
        self.pool = KVBlockPool(runner.num_kv_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.block_size)
        self.scheduler = Scheduler(self.config, self.kv)
        self.sampler = Sampler(runner.device)
        self._requests: dict[str, Request] = {}
        self._live: dict[str, _Live] = {}
        self._arrivals = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_tokens_last_step = 0
        self._num_steps = 0

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, config: EngineConfig | None = None, progress: Callable[[str], None] | None = None
    ) -> LLMEngine:
        config = config or EngineConfig()
        torch.manual_seed(config.seed)
        if progress:
            progress(f"loading model from {model_dir}")
        runner = ModelRunner(model_dir, config, progress)
        tokenizer = load_tokenizer(model_dir)
        engine = cls(runner, tokenizer, config)
        if progress:
            progress("model loaded")
        return engine

    # -- requests ---------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestRejectedError("prompt must not be empty", "invalid_request", "prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise :class:`RequestRejectedError` for a request that can never run."""
        n = len(prompt_token_ids)
        vocab = self.runner.spec.vocab_size
        if n == 0:
            raise RequestRejectedError("prompt must not be empty", "invalid_request", "prompt")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejectedError(f"prompt token ids must be integers in [0, {vocab})", "invalid_request", "prompt")
        cfg = self.config
        if n + params.max_tokens > self.max_model_len:
            raise RequestRejectedError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context "
                f"length ({self.max_model_len} tokens); shorten the prompt or lower max_tokens",
                "prompt_too_long", "max_tokens" if n < self.max_model_len else "prompt",
            )
        if not cfg.enable_chunked_context and n > cfg.max_num_tokens:
            raise RequestRejectedError(
                f"prompt ({n} tokens) exceeds max_num_tokens ({cfg.max_num_tokens}) and chunked context is off",
                "prompt_too_long", "prompt",
            )
        if cdiv(n + params.max_tokens, cfg.block_size) > self.pool.num_blocks:
            raise RequestRejectedError(
                f"prompt + max_tokens ({n + params.max_tokens} tokens) is larger than the whole KV cache "
                f"({self.pool.num_blocks * cfg.block_size} tokens); lower max_tokens",
                "too_large_for_cache", "max_tokens",
            )

    def add_request(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, arrival_time: float | None = None,
    ) -> None:
        if req_id in self._requests:
            raise RequestRejectedError(f"request id {req_id!r} is already in use", "invalid_request")
        self.validate_request(prompt_token_ids, params)
        if self.scheduler.num_waiting >= self.config.max_queue_len:
            raise QueueFullError(self.config.max_queue_len)
        self._add(req_id, prompt_token_ids, params, priority, arrival_time)

    def _add(
        self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int, arrival_time: float | None,
    ) -> None:
        req = Request(req_id, prompt_token_ids, params, priority, arrival_time, self._arrivals)
        self._arrivals += 1
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.runner.device)
            seed = params.seed if params.seed is not None else hash((self.config.seed, req.arrival_seq))
            generator.manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
        skip = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
        self._live[req_id] = _Live(IncrementalDetokenizer(self.tokenizer, params.stop, skip), generator)
        self._requests[req_id] = req
        self.scheduler.add(req)

    def abort_request(self, req_id: str) -> RequestOutput | None:
        req = self._requests.get(req_id)
        if req is None:
            return None
        self.scheduler.remove(req)
        req.finish_reason = "abort"
        return self._finish_output(req, (), "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self._num_steps += 1
        self._num_tokens_last_step = sched.num_batched_tokens
        if sched.is_empty:
            return []
        now = time.monotonic()
        for req in sched.admitted:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        batch = self.runner.prepare(sched.chunks)
        logits = self.runner.execute(batch)
        rows = [self._sampling_row(c.request) for c in batch.sampled_chunks]
        sampled = self.sampler.sample(logits, rows)
        for chunk in sched.chunks:
            self._advance(chunk)
        outputs: list[RequestOutput] = []
        now = time.monotonic()
        for chunk, token_id, logprob in zip(batch.sampled_chunks, sampled.token_ids, sampled.logprobs, strict=True):
            out = self._append_token(chunk.request, token_id, logprob, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def _sampling_row(self, req: Request) -> SamplingRow:
        return SamplingRow(
            req.params, req.prompt_token_ids, req.output_token_ids,
            self._live[req.req_id].generator, self.eos_token_ids,
        )

    def _advance(self, chunk: ScheduledChunk) -> None:
        req = chunk.request
        req.num_computed_tokens += chunk.num_tokens
        self.kv.cache_computed_blocks(req)

    def _append_token(
        self, req: Request, token_id: int, logprob: TokenLogprob | None, now: float
    ) -> RequestOutput | None:
        live = self._live[req.req_id]
        req.append_token(token_id)
        self._num_generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            self._num_prompt_tokens += req.num_prompt_tokens
        if logprob is not None:
            live.pending_logprobs.append(logprob)
        reason = self._stop_reason(req, token_id, live.detok.append(token_id))
        new_ids = (token_id,)
        if reason is None:
            return self._delta(req, new_ids, live.detok.take_delta(False), False, None)
        self.scheduler.remove(req)
        req.finish_reason = reason
        live.detok.flush()
        return self._finish_output(req, new_ids, live.detok.take_delta(True))

    def _stop_reason(self, req: Request, token_id: int, hit_stop_string: bool) -> str | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if token_id in p.stop_token_ids or hit_stop_string:
                return "stop"
        elif hit_stop_string:
            return "stop"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _delta(
        self, req: Request, new_ids: tuple[int, ...], text: str, finished: bool,
        reason: str | None, times: RequestTimes | None = None,
    ) -> RequestOutput:
        live = self._live[req.req_id]
        logprobs = tuple(live.pending_logprobs) if req.params.logprobs is not None else None
        live.pending_logprobs.clear()
        return RequestOutput(
            req_id=req.req_id, new_token_ids=new_ids, new_text=text, finished=finished,
            finish_reason=reason, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens, num_cached_tokens=req.num_cached_tokens,
            new_logprobs=logprobs, times=times,
        )

    def _finish_output(self, req: Request, new_ids: tuple[int, ...], text: str) -> RequestOutput:
        times = RequestTimes(req.arrival_time, req.first_scheduled_time, req.first_token_time, time.monotonic())
        out = self._delta(req, new_ids, text, True, req.finish_reason, times)
        del self._requests[req.req_id]
        del self._live[req.req_id]
        return out

    # -- stats and live config ----------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks=self.pool.num_blocks,
            num_used_kv_blocks=self.pool.num_used_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_tokens_last_step=self._num_tokens_last_step,
            num_steps=self._num_steps,
            max_num_sequences=self.config.max_num_sequences,
        )

    def update_config(self, **changes: Any) -> EngineConfig:
        """Change live-tunable knobs (``LIVE_TUNABLE_FIELDS``) without a restart."""
        bad = sorted(set(changes) - set(LIVE_TUNABLE_FIELDS))
        if bad:
            raise ValueError(
                f"cannot change {', '.join(bad)} on a running engine; live-tunable: {', '.join(LIVE_TUNABLE_FIELDS)}"
            )
        self.config = self.config.replace(**changes)
        self.scheduler.config = self.config
        return self.config

    def warmup(self) -> None:
        """Run one tiny request through every stage so the first real one pays no start-up cost."""
        req_id = "__warmup__"
        self._add(req_id, self.encode_prompt("warm up"), SamplingParams(max_tokens=2, temperature=0.0), 0, None)
        while req_id in self._requests:
            self.step()
        self.pool.reset_prefix_cache()
        self.kv.prefix_cache_queries = self.kv.prefix_cache_hits = 0
        self._num_prompt_tokens = self._num_generation_tokens = self._num_steps = 0

