"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM vocabulary).

Validation happens at construction and raises ``ValueError`` naming the field and the fix,
so the server can turn it into an HTTP 400 with ``param`` set. Knows nothing about torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling and stopping parameters. ``temperature == 0`` means greedy."""

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
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's plus k alternatives

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        _number_in("temperature", self.temperature, 0.0, 2.0, low_open=False)
        _number_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _number_in("min_p", self.min_p, 0.0, 1.0, low_open=False)
        _number_in("presence_penalty", self.presence_penalty, -2.0, 2.0, low_open=False)
        _number_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, low_open=False)
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 10] (got {self.repetition_penalty!r}); 1 disables it."
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (got {self.top_k!r}); 0 or -1 disables it.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer (got {self.seed!r}).")
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be at most {MAX_LOGPROBS} (got {self.logprobs}).")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false (got {self.ignore_eos!r}).")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings (got {s!r}).")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers (got {t!r}).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_at_least(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (got {value!r}).")


def _number_in(name: str, value: object, low: float, high: float, *, low_open: bool) -> None:
    ok = _is_number(value) and (low < value if low_open else low <= value) and value <= high  # type: ignore[operator]
    if not ok:
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low:g}, {high:g}] (got {value!r}).")
