"""Values the engine hands out: per-step request deltas, finished results, engine stats, errors.

These cross module boundaries (engine -> server, engine -> LLM API), so they are frozen
dataclasses. Knows nothing about torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class RequestRejectedError(ValueError):
    """A request the engine will never run. ``reason`` is a short label for metrics.

    ``param`` names the offending request field where there is one (for the OpenAI error).
    Reasons: ``prompt_too_long``, ``too_large_for_cache``, ``invalid_request``,
    ``queue_full`` (the only one a client should retry).
    """

    def __init__(self, message: str, reason: str, param: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.param = param

    def __reduce__(self) -> tuple[object, ...]:  # crosses the engine-core process boundary
        return (RequestRejectedError, (str(self), self.reason, self.param))


class QueueFullError(RequestRejectedError):
    """The waiting queue (or ``what`` of it: under the fair policy a tenant's share) holds
    ``max_queue_len`` requests; retry later (HTTP 429)."""

    def __init__(self, max_queue_len: int, what: str = "the server's waiting queue") -> None:
        super().__init__(f"{what} is full ({max_queue_len} requests); retry shortly", reason="queue_full")
        self.max_queue_len = max_queue_len
        self.what = what

    def __reduce__(self) -> tuple[object, ...]:
        return (QueueFullError, (self.max_queue_len, self.what))


class FailedSteps:
    """Counts engine steps that raised a plain ``Exception`` in a row: such a step fails the
    requests in flight and the engine goes on, but ``limit`` in a row make it fatal."""

    def __init__(self, limit: int = 3) -> None:
        self.limit = limit
        self.in_a_row = 0

    def failed(self, exc: Exception) -> str:
        """Record a failed step; the reason to give its requests. Raises ``EngineFatalError``
        (from ``exc``) at the limit."""
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            raise EngineFatalError(f"{self.in_a_row} engine steps in a row failed") from exc
        return f"engine step failed: {exc!r}"

    def succeeded(self) -> None:
        self.in_a_row = 0


class EngineFatalError(RuntimeError):
    """The engine cannot go on (a tensor-parallel worker died, the device is gone, ...).

    Unlike an error caused by one request, nothing is gained by failing only some requests:
    the server answers every waiting client, turns ``/health`` to 503 and exits non-zero so
    the orchestrator restarts the process.
    """


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one generated token and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    rank: int | None = None  # 1-based rank in the vocabulary (prompt logprobs); None: not computed


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """Wall-clock (time.monotonic) milestones of one request, for latency metrics."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens since the last step.

    Treat it as immutable. It is the one value built per row per step, in the engine core and
    again in the front end, so it is not ``frozen``: a frozen dataclass's ``__init__`` sets each
    of its 14 fields through ``object.__setattr__`` (2.45 us a row here, against 0.71 us), which
    was ~15% of each process's CPU per streamed token.

    ``new_text`` is the detokenized delta, filled in outside the engine (whose outputs carry
    ``""``) by :class:`~inflight.runtime.engine_core.output_text.OutputText`; text that might be
    the start of a stop string is held back until it is known not to be. When ``finished`` is true this is the request's
    last output and ``finish_reason`` is ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``
    (the engine failed on it, or ``error`` says why the request itself could not go on).
    """

    req_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: tuple[TokenLogprob, ...] | None = None
    times: RequestTimes | None = None
    # With SamplingParams.prompt_logprobs: prompt tokens 1.. (token 0 has no context), once,
    # on the request's first output.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    # With finish_reason "error": the client-facing reason when the request itself was at
    # fault (e.g. output its grammar could not follow); None for an engine fault.
    error: str | None = None
    # A pooling engine's answer, on the request's one (finished) output: the pooled vector (or a
    # classifier's logits) as little-endian float32 bytes, before any normalization.
    pooled: bytes | None = None
    # With finish_reason "stop" at a stop string: that string (vLLM's stop_reason); None otherwise.
    stop_reason: str | None = None


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    """The offline API's result for one prompt."""

    req_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0


def _reduce_by_fields(value: Any) -> tuple[Any, ...]:
    """``__reduce__`` for a frozen slots dataclass that crosses the process boundary every step:
    its class and its fields in order, instead of dataclasses' Python ``__getstate__`` (which
    calls ``fields()`` on every pickle) and ``__setstate__``."""
    cls = type(value)
    return (cls, tuple(getattr(value, name) for name in cls.__slots__))


@dataclass(frozen=True, slots=True)
class TenantStats:
    """Per-tenant figures as columns (entry i of each is tenant ``labels[i]``): columns of
    plain ints pickle fast, and this crosses the process boundary with every step."""

    labels: tuple[str, ...]  # sanitised, bounded in number (tenant_stats.MAX_TRACKED_TENANTS + 1)
    num_running: tuple[int, ...]
    num_waiting: tuple[int, ...]
    prompt_tokens: tuple[int, ...]  # cumulative
    generation_tokens: tuple[int, ...]  # cumulative

    __reduce__ = _reduce_by_fields


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for the server's metrics and the autoscaler."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_kv_blocks: int
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative prompt tokens looked up
    prefix_cache_hits: int  # cumulative prompt tokens found cached
    num_prompt_tokens: int  # cumulative whole prompts (cache hits included) of requests at their first token
    num_generation_tokens: int  # cumulative tokens generated
    num_tokens_last_step: int
    num_steps: int
    max_num_sequences: int
    # Speculative decoding (cumulative): sequences that speculated in a step, the draft tokens
    # they proposed, those the model kept, and how many were kept at each draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    tenants: TenantStats | None = None  # fair policy only (inflight.runtime.core.tenant_stats)
    # Cumulative seconds the device spent executing steps (its rate is NVML's utilisation);
    # None where it is not measured (only the simulated device measures it yet).
    device_busy_seconds: float | None = None
    # The TTFT backlog (inflight.runtime.core.prefill_backlog): tokens still to be prefilled
    # (waiting prompts, running prompts' rest), prefill tokens computed (cumulative, prefix-cache
    # hits excluded), and the measured prefill rate (tokens per second while a backlog existed;
    # 0.0 until one was worked on).
    num_prefill_backlog_tokens: int = 0
    num_prefill_computed_tokens: int = 0
    prefill_tokens_per_second: float = 0.0
    # The host KV tier (kv_offloading_size; all 0 without one): its blocks and those in use, the
    # prompt tokens looked up past the device's prefix hits and found there (vLLM's external prefix
    # cache), blocks copied out (saved) and in (loaded) and their bytes, evicted device blocks it
    # could not take (every slot pinned by the step's copy-ins). Cumulative but the block counts.
    num_host_kv_blocks: int = 0
    num_used_host_kv_blocks: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_stored_blocks: int = 0
    kv_offload_loaded_blocks: int = 0
    kv_offload_bytes: int = 0
    kv_offload_dropped_blocks: int = 0
    # LoRA (--enable-lora): the adapters of running requests and of waiting ones, each name once
    # (vllm:lora_requests_info; the engine core fills them from LLMEngine.lora_stats()).
    # Per-group KV tables (core/kv_groups.py): each group's name ("full-0", "sliding16-1"...) and the
    # distinct pool blocks its tables hold now; both empty with one table for every layer.
    kv_group_names: tuple[str, ...] = ()
    kv_blocks_held_by_group: tuple[int, ...] = ()
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    __reduce__ = _reduce_by_fields

    @property
    def kv_cache_usage(self) -> float:
        return self.num_used_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 0.0

    @property
    def host_kv_cache_usage(self) -> float:
        return self.num_used_host_kv_blocks / self.num_host_kv_blocks if self.num_host_kv_blocks else 0.0
