"""Workloads: seeded lists of requests (prompt text, max_tokens, arrival offset).

A *burst* sends every request at time 0; a *Poisson* workload spaces arrivals by
exponential gaps at a given rate. Prompt and output lengths are lognormal around a median,
clipped to a range. Prompts are decoded from random token ids of the benchmark model's own
tokenizer, so every system receives the same text and re-tokenizes it to about the target
length (the exact counts come back in each server's ``usage``). Knows nothing about servers.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from inflight.bench.client import RequestSpec


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """How many requests and how long their prompts and outputs are (token medians)."""

    num_requests: int
    prompt_median: int
    output_median: int
    sigma: float = 0.5  # lognormal shape: 0.5 gives roughly a 2.7x spread between p5 and p95
    min_tokens: int = 4
    max_prompt: int = 512
    max_output: int = 256


def lognormal_lengths(rng: random.Random, n: int, median: int, sigma: float, lo: int, hi: int) -> list[int]:
    """``n`` lengths from a lognormal with the given median, clipped to ``[lo, hi]``."""
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def prompt_text(tokenizer: Any, rng: random.Random, num_tokens: int) -> str:
    """Text of about ``num_tokens`` tokens: random ordinary (non-special) ids, decoded."""
    special = set(tokenizer.all_special_ids)
    vocab = len(tokenizer)
    ids: list[int] = []
    while len(ids) < num_tokens:
        token_id = rng.randrange(vocab)
        if token_id not in special:
            ids.append(token_id)
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return text or "hello"


def _requests(tokenizer: Any, shape: WorkloadShape, seed: int, arrivals: list[float]) -> list[RequestSpec]:
    rng = random.Random(seed)
    n = shape.num_requests
    prompts = lognormal_lengths(rng, n, shape.prompt_median, shape.sigma, shape.min_tokens, shape.max_prompt)
    outputs = lognormal_lengths(rng, n, shape.output_median, shape.sigma, shape.min_tokens, shape.max_output)
    return [
        RequestSpec(prompt_text(tokenizer, rng, p), o, a)
        for p, o, a in zip(prompts, outputs, arrivals, strict=True)
    ]


def burst(tokenizer: Any, shape: WorkloadShape, seed: int = 0) -> list[RequestSpec]:
    """Every request at time 0."""
    return _requests(tokenizer, shape, seed, [0.0] * shape.num_requests)


def poisson(tokenizer: Any, shape: WorkloadShape, rate_per_s: float, seed: int = 0) -> list[RequestSpec]:
    """Arrivals of a Poisson process at ``rate_per_s`` requests per second (seeded)."""
    if rate_per_s <= 0:
        raise ValueError(f"rate must be positive (got {rate_per_s})")
    rng = random.Random(seed + 7919)
    t, arrivals = 0.0, []
    for _ in range(shape.num_requests):
        arrivals.append(t)
        t += rng.expovariate(rate_per_s)
    return _requests(tokenizer, shape, seed, arrivals)
