"""The per-request histograms of one server: vLLM's names (``inflight:`` for ``vllm:``), its
``model_name`` label and its buckets, observed when an engine request (one choice) finishes.

Owns the bucket families (copied from vLLM 0.32's ``vllm/v1/metrics/buckets.py``, so a quantile
read here and on vLLM interpolates over the same edges) and how a finished request's
``RequestTimes`` and token counts become samples, the way vLLM's ``IterationStats`` makes them:
prefill = first token - first scheduled, decode = finished - first token, inference = finished
- first scheduled; the per-prompt figures (the largest output among a prompt's ``n`` choices,
``n``) once, when the prompt's last choice finishes. The token-count buckets run 1-2-5 up to the
model's context length, which is known once the engine has loaded: those histograms are made at
the first finished request. Knows nothing about HTTP or the engine; :mod:`.metrics` builds one
:class:`RequestHistograms` per app and hands it the registry (None: several front ends, whose
samples live in prometheus_client's multiprocess files).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram

from inflight.runtime.outputs import RequestOutput, RequestTimes

# vLLM's bucket families (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's ``request_tokens`` family: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1 for the token-count buckets, not {max_model_len}")
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Choice(Protocol):
    """What the per-prompt figures read of each choice of a prompt (the server's ``ChoiceState``)."""

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def num_output_tokens(self) -> int: ...


class _TokenHistograms:
    """The token-count histograms, whose buckets depend on the model's context length."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None, max_model_len: int) -> None:
        tokens = request_tokens_buckets(max_model_len)
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, registry=registry, buckets=buckets)

        self.max_model_len = max_model_len
        self.prompt = histogram("inflight:request_prompt_tokens",
                                "Prompt tokens of each finished request (prefix-cache hits included).",
                                tokens).labels(model_name)
        self.generation = histogram("inflight:request_generation_tokens",
                                    "Tokens generated for each finished request.", tokens).labels(model_name)
        self.prefill_computed = histogram("inflight:request_prefill_kv_computed_tokens",
                                          "Prompt tokens each finished request computed (prefix-cache hits "
                                          "excluded).", tokens).labels(model_name)
        self.max_generation = histogram("inflight:request_max_num_generation_tokens",
                                        "Per prompt: the most tokens any of its n choices generated.",
                                        tokens).labels(model_name)
        self.max_tokens = histogram("inflight:request_params_max_tokens",
                                    "The max_tokens parameter of each finished request (filled in to the "
                                    "context's room where a chat request left it out).", tokens).labels(model_name)
        self.n = histogram("inflight:request_params_n", "Per prompt: the n request parameter.",
                           REQUEST_PARAMS_N_BUCKETS).labels(model_name)


def observe_many(histogram: Histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe(a)`` for each of ``amounts``, with one update of each bucket hit and of
    the sum instead of two locked updates per amount (the inter-token gaps: one per streamed
    token). Reads prometheus_client's ``_upper_bounds``, ``_buckets`` and ``_sum``, as its own
    ``observe`` does; a test checks the exposition equals one ``observe`` per amount, so a
    release that changes them fails there, not in a scrape."""
    if not amounts:
        return
    bounds, buckets = histogram._upper_bounds, histogram._buckets  # noqa: SLF001 - see above
    histogram._raise_if_not_observable()  # noqa: SLF001
    histogram._sum.inc(sum(amounts))  # noqa: SLF001
    for index, count in Counter(bisect_left(bounds, a) for a in amounts).items():
        buckets[index].inc(count)  # the first bucket whose bound is >= the amount (+Inf is last)


class RequestHistograms:
    """Every per-request histogram of one app. ``max_model_len`` is read at the first finished
    request (the engine has loaded by then)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None,
                 max_model_len: Callable[[], int] | None) -> None:
        self._model_name = model_name
        self._registry = registry
        self._max_model_len = max_model_len
        self._tokens: _TokenHistograms | None = None
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            # One labelled child each, made once (as vLLM does): .labels() per observation costs a
            # lock and a dict lookup for every streamed token.
            return Histogram(name, doc, label, registry=registry, buckets=buckets).labels(model_name)

        self.ttft = histogram("inflight:time_to_first_token_seconds",
                              "Time from arrival to the first output token.", TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("inflight:inter_token_latency_seconds",
                             "Time between consecutive output deliveries of a request.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("inflight:request_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("inflight:e2e_request_latency_seconds",
                             "Time from arrival to the last token.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("inflight:request_queue_time_seconds",
                                    "Time from arrival to first scheduling.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("inflight:request_prefill_time_seconds",
                                      "Time from first scheduling to the first output token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("inflight:request_decode_time_seconds",
                                     "Time from the first output token to the last.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("inflight:request_inference_time_seconds",
                                        "Time from first scheduling to the last output token.",
                                        REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram("inflight:iteration_tokens_total",
                                          "Tokens computed per engine step.", ITERATION_TOKENS_BUCKETS)

    def observe(self, out: RequestOutput, times: RequestTimes, max_tokens: int | None,
                siblings: Sequence[Choice]) -> None:
        """One finished engine request (one choice): its latencies and token counts; with the
        last of ``siblings`` (the choices of its prompt, this one included and already marked
        finished; empty for a prompt of one choice) the per-prompt figures too."""
        self._observe_times(out.num_output_tokens, times)
        tokens = self._token_histograms()
        tokens.prompt.observe(out.num_prompt_tokens)
        tokens.generation.observe(out.num_output_tokens)
        tokens.prefill_computed.observe(max(0, out.num_prompt_tokens - out.num_cached_tokens))
        if max_tokens:
            tokens.max_tokens.observe(max_tokens)
        if not siblings:
            tokens.max_generation.observe(out.num_output_tokens)
            tokens.n.observe(1)
        elif all(s.finish_reason is not None for s in siblings):
            tokens.max_generation.observe(max(s.num_output_tokens for s in siblings))
            tokens.n.observe(len(siblings))

    def _observe_times(self, num_output_tokens: int, times: RequestTimes) -> None:
        arrival, scheduled, first, finished = times.arrival, times.first_scheduled, times.first_token, times.finished
        if scheduled is not None:
            self.queue_time.observe(max(0.0, scheduled - arrival))
        if first is not None:
            self.ttft.observe(max(0.0, first - arrival))
            if scheduled is not None:
                self.prefill_time.observe(max(0.0, first - scheduled))
        if finished is None:
            return
        self.e2e.observe(max(0.0, finished - arrival))
        if scheduled is not None:
            self.inference_time.observe(max(0.0, finished - scheduled))
        if first is not None:
            self.decode_time.observe(max(0.0, finished - first))
            if num_output_tokens > 1:
                self.tpot.observe(max(0.0, (finished - first) / (num_output_tokens - 1)))

    def _token_histograms(self) -> _TokenHistograms:
        if self._tokens is None:
            if self._max_model_len is None:
                raise RuntimeError("these metrics were made without max_model_len: they cannot count tokens")
            self._tokens = _TokenHistograms(self._model_name, self._registry, self._max_model_len())
        return self._tokens
