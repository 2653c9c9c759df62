"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM vocabulary).

Validation happens at construction and raises :class:`ParamError` (a ``ValueError`` whose
``field`` names the offending field) with the fix, so the server can turn it into an HTTP 400
with ``param`` set. The bounds here are the ones
that hold for any model (counts, lengths, integer ranges a tensor can hold); the checks that
need the loaded model (token ids below the vocabulary size, the context length) live in
``LLMEngine.validate_request``. Knows nothing about torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.runtime.structured.params import StructuredOutputsParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOP_K = 2**31 - 1  # larger means "no top-k" anyway; bigger ints overflow int64 tensors
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
GREEDY_TEMPERATURE = 1e-5


class ParamError(ValueError):
    """A sampling parameter out of its bounds; ``field`` is its name."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling and stopping parameters. ``temperature`` below
    ``GREEDY_TEMPERATURE`` (including 0) means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    min_tokens: int = 0
    ignore_eos: bool = False
    # False: special tokens (other than EOS / stop tokens) stay in the text, as vLLM's field; a
    # tool or reasoning format whose markers are special tokens (gpt-oss harmony) needs them
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's plus k alternatives
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's plus k alternatives
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token_id, bias in [-100, 100]) added to logits
    structured: StructuredOutputsParams | None = None  # a grammar the output must match
    pooling: bool = False  # pool the prompt (/v1/embeddings on a generate model): core/mixed_pooling.py

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        _number_in("temperature", self.temperature, 0.0, 2.0, low_open=False)
        _number_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _number_in("min_p", self.min_p, 0.0, 1.0, low_open=False)
        _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0, low_open=False)
        _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, low_open=False)
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise ParamError("repetition_penalty",
                f"repetition_penalty must be in (0, 10] (got {brief(self.repetition_penalty)}); 1 disables it."
            )
        if (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                or not -1 <= self.top_k <= MAX_TOP_K):
            raise ParamError("top_k",
                f"top_k must be an integer in [-1, {MAX_TOP_K}] (got {brief(self.top_k)}); 0 or -1 disables it."
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise ParamError("seed", f"seed must be an integer in [-2**63, 2**64 - 1] (got {brief(self.seed)}).")
        # The ceiling on these counts is the server's (--max-logprobs); the engine checks them
        # against the vocabulary (input_checks).
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _int_at_least("prompt_logprobs", self.prompt_logprobs, 0)
        _check_logit_bias(self)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputsParams):
            raise ParamError("structured", "structured must be a StructuredOutputsParams.")
        if self.structured is not None and self.min_tokens:
            raise ParamError("min_tokens", "min_tokens cannot be combined with a structured-output constraint: the grammar "
                             "decides where the output ends, and min_tokens would ban the end it needs.")
        if not isinstance(self.skip_special_tokens, bool):
            raise ParamError("skip_special_tokens", f"skip_special_tokens must be true or false "
                                                    f"(got {brief(self.skip_special_tokens)}).")
        if not isinstance(self.ignore_eos, bool):
            raise ParamError("ignore_eos", f"ignore_eos must be true or false (got {brief(self.ignore_eos)}).")
        self._check_stops()

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"stop takes at most {MAX_STOP_STRINGS} strings (got {len(self.stop)}).")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise ParamError("stop",
                    f"stop must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters "
                    f"(got {brief(s)})."
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ParamError("stop_token_ids",
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids (got {len(self.stop_token_ids)})."
            )
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ParamError("stop_token_ids", f"stop_token_ids must be non-negative integers (got {brief(t)}).")

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_TEMPERATURE`` are greedy (as in vLLM): dividing logits
        by 1e-300 overflows to inf and NaN in float32."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def brief(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, so an error never echoes a huge input back."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"<an integer of {value.bit_length()} bits>"
    text = repr(value) if not isinstance(value, (list, tuple, dict, str)) or len(value) < limit else None
    if text is None:
        return f"<a {type(value).__name__} of length {len(value)}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_logit_bias(params: SamplingParams) -> None:
    bias = params.logit_bias
    if isinstance(bias, dict):
        bias = tuple(bias.items())
    pairs = []
    for token, value in bias:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ParamError("logit_bias", f"logit_bias keys must be non-negative token ids (got {token!r}).")
        if not _is_number(value) or not -100.0 <= value <= 100.0:
            raise ParamError("logit_bias", f"logit_bias values must be in [-100, 100] (got {value!r} for token {token}).")
        pairs.append((token, float(value)))
    object.__setattr__(params, "logit_bias", tuple(pairs))


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_at_least(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ParamError(name, f"{name} must be an integer >= {minimum} (got {brief(value)}).")


def _number_in(name: str, value: object, low: float, high: float, *, low_open: bool) -> None:
    ok = _is_number(value) and (low < value if low_open else low <= value) and value <= high  # type: ignore[operator]
    if not ok:
        bracket = "(" if low_open else "["
        raise ParamError(name, f"{name} must be in {bracket}{low:g}, {high:g}] (got {brief(value)}).")
