"""Checks of a request against the loaded model and the live engine config, before it is queued.

Owns every rule that needs the model or the config (the general bounds of each parameter are
``SamplingParams``'): token ids inside the vocabulary (prompt, ``stop_token_ids``,
``logit_bias``), ``logprobs`` and ``prompt_logprobs`` no larger than the vocabulary, prompt +
``max_tokens`` within the context and the KV cache, and the token budget rule that keeps a
prompt from being stranded with chunked context off. Each failure is a
``RequestRejectedError`` naming the field, so nothing a client sends can make
``LLMEngine.step()`` raise. Knows nothing about torch or scheduling state.
"""

from __future__ import annotations

from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.kv_manager import cdiv
from inflight.runtime.outputs import RequestRejectedError
from inflight.runtime.sampling_params import SamplingParams

MAX_CACHE_SALT_CHARS = 1024  # vLLM sets no bound; a salt is an id or a random token


def check_request(prompt_token_ids: list[int], params: SamplingParams, config: EngineConfig, vocab_size: int) -> None:
    """Raise :class:`RequestRejectedError` for a request the engine can never run.

    ``config`` is the live engine config with ``max_model_len`` and ``num_kv_blocks`` resolved.
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestRejectedError("prompt must not be empty", "invalid_request", "prompt")
    _check_params_for_vocab(params, vocab_size)
    max_model_len = config.max_model_len or 0
    if n + params.max_tokens > max_model_len:
        raise RequestRejectedError(
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context "
            f"length ({max_model_len} tokens); shorten the prompt or lower max_tokens",
            "prompt_too_long", "max_tokens" if n < max_model_len else "prompt",
        )
    if not config.enable_chunked_context and n > config.max_num_tokens:
        raise RequestRejectedError(
            f"prompt ({n} tokens) exceeds max_num_tokens ({config.max_num_tokens}) and chunked context is off",
            "prompt_too_long", "prompt",
        )
    num_blocks = config.num_kv_blocks or 0
    if cdiv(n + params.max_tokens, config.block_size) > num_blocks:
        raise RequestRejectedError(
            f"prompt + max_tokens ({n + params.max_tokens} tokens) is larger than the whole KV cache "
            f"({num_blocks * config.block_size} tokens); lower max_tokens",
            "too_large_for_cache", "max_tokens",
        )
    # last: the per-token scan is the one check whose cost grows with the prompt
    if not all(type(t) is int for t in prompt_token_ids) or not 0 <= min(prompt_token_ids) <= max(
            prompt_token_ids) < vocab_size:
        raise RequestRejectedError(
            f"prompt token ids must be integers in [0, {vocab_size})", "invalid_request", "prompt")


def check_cache_salt(cache_salt: object) -> None:
    """vLLM's rule for ``cache_salt`` (a non-empty string when given), with a bound on its
    length: a :class:`RequestRejectedError` naming the field otherwise."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise RequestRejectedError(
            f"Parameter 'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters "
            "if provided.", "invalid_request", "cache_salt")


def check_token_budget(config: EngineConfig) -> None:
    """Refuse ``max_num_tokens < max_model_len`` with chunked context off: a long prompt could
    never be scheduled and would block every request queued behind it."""
    if config.enable_chunked_context or config.max_model_len is None:
        return
    if config.max_num_tokens < config.max_model_len:
        raise ValueError(
            f"max_num_tokens ({config.max_num_tokens}) must be at least max_model_len "
            f"({config.max_model_len}) when chunked context is off, or a prompt that long could never "
            "be scheduled; raise max_num_tokens, lower max_model_len or enable chunked context."
        )


def _check_params_for_vocab(params: SamplingParams, vocab: int) -> None:
    """The sampling parameters that index the vocabulary must stay inside it."""
    bad = next((t for t in params.stop_token_ids if t >= vocab), None)
    if bad is not None:
        raise RequestRejectedError(
            f"stop_token_ids must be token ids in [0, {vocab}) for this model (got {bad})",
            "invalid_request", "stop_token_ids",
        )
    bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
    if bad is not None:
        raise RequestRejectedError(
            f"logit_bias keys must be token ids in [0, {vocab}) for this model (got {bad})",
            "invalid_request", "logit_bias",
        )
    if params.logprobs is not None and params.logprobs > vocab:
        raise RequestRejectedError(
            f"logprobs asks for {params.logprobs} alternatives; this model's vocabulary has {vocab} tokens",
            "invalid_request", "logprobs",
        )
    if params.prompt_logprobs is not None and params.prompt_logprobs > vocab:
        raise RequestRejectedError(
            f"prompt_logprobs asks for {params.prompt_logprobs} alternatives; this model's vocabulary has "
            f"{vocab} tokens", "invalid_request", "prompt_logprobs",
        )


def kv_cache_problem(engine: Any) -> str | None:
    """vLLM's start-up refusal: the KV cache must hold at least one full-length sequence."""
    capacity = engine.config.num_kv_blocks * engine.config.block_size
    if capacity >= engine.max_model_len:
        return None
    return (f"the KV cache holds {capacity} tokens, fewer than one full-length sequence "
            f"(max_model_len {engine.max_model_len}); raise --num-kv-blocks (on CUDA: "
            "--kv-cache-free-gpu-mem-fraction) or lower --max-model-len")
