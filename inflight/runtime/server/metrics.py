"""Prometheus metrics of one server app, in that app's own ``CollectorRegistry``.

Owns the engine's metric names (vLLM's, with the ``inflight:`` prefix; see docs/CONTRACTS.md)
and the ``model_name`` label, and puts together the per-request histograms
(:mod:`.request_metrics`, with vLLM's buckets) and the ``process_*`` / ``python_*`` collectors
(:mod:`.process_metrics`). Engine gauges and cumulative counters are read from
an ``EngineStats`` snapshot at scrape time (a custom collector), so they never drift from
the engine; per-request histograms and the success / rejection counters are observed by
the handlers. A value that cannot be a sample (an integer too large for a float, a non-number)
is left out of the scrape and logged once: a scrape never fails on a value (issue 46: one
400-digit admin setting turned every scrape into a 500 and blinded the autoscaler).

Several front-end processes (``--api-server-count``) share one set of figures: each observes
its own requests into prometheus_client's multiprocess files (:func:`enable_multiprocess`, a
private directory the server makes and removes, as vLLM does) and every scrape sums them all
(``MultiProcessCollector``), so /metrics on any front end reports the whole server; the engine's
figures come from the core's stats, the same in every front end, and the per-step histogram is
observed by front end 0 alone (each front end sees every step). With ``--enable-lora`` the scrape
has vLLM's ``vllm:lora_requests_info`` under its own name (the endpoint picker's
``--lora-info-metric`` default) and as ``inflight:lora_requests_info``: value the scrape's time,
labels ``max_lora``, ``running_lora_adapters`` and ``waiting_lora_adapters`` (names joined by
commas). Knows nothing about HTTP routing or the OpenAI API.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from inflight.runtime.config import EngineConfig
from inflight.runtime.outputs import EngineStats, RequestOutput, RequestTimes, TenantStats
from inflight.runtime.server.process_metrics import add_process_collectors
from inflight.runtime.server.request_metrics import Choice, RequestHistograms, observe_many

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
logger = logging.getLogger("inflight.server.metrics")

# (name, help, EngineStats -> value)
_GAUGES: tuple[tuple[str, str, Callable[[EngineStats], float]], ...] = (
    ("inflight:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
     lambda s: s.kv_cache_usage),
    ("inflight:num_requests_running", "Requests in the running batch.", lambda s: s.num_running),
    ("inflight:num_requests_waiting", "Requests waiting for admission.", lambda s: s.num_waiting),
    ("inflight:max_num_sequences", "Live max_num_sequences (batch size limit).",
     lambda s: s.max_num_sequences),
    ("inflight:num_kv_blocks", "KV-cache blocks in the pool.", lambda s: s.num_kv_blocks),
    ("inflight:host_kv_cache_usage_perc", "Fraction of the host KV tier's blocks in use (0..1; 0 without "
     "--kv-offloading-size).", lambda s: s.host_kv_cache_usage),
    ("inflight:num_host_kv_blocks", "Blocks of the host KV tier (--kv-offloading-size).",
     lambda s: s.num_host_kv_blocks),
    ("inflight:num_prefill_backlog_tokens", "Prompt tokens still to be prefilled: waiting requests' prompts "
     "(recomputes included) and the rest of running prompts.", lambda s: s.num_prefill_backlog_tokens),
    ("inflight:prefill_tokens_per_second", "Measured prefill rate: prompt tokens computed per second while a "
     "backlog existed (decayed; 0 until one was worked on).", lambda s: s.prefill_tokens_per_second),
)
_COUNTERS: tuple[tuple[str, str, Callable[[EngineStats], float]], ...] = (
    ("inflight:num_preemptions_total", "Requests preempted (freed, recomputed later).",
     lambda s: s.num_preemptions),
    ("inflight:prompt_tokens_total", "Prompt tokens of requests that started generating (prefix-cache hits "
     "included, as vLLM counts them).", lambda s: s.num_prompt_tokens),
    ("inflight:generation_tokens_total", "Tokens generated.", lambda s: s.num_generation_tokens),
    ("inflight:prefill_computed_tokens_total", "Prompt tokens computed by prefill (prefix-cache hits excluded, "
     "recomputes included).", lambda s: s.num_prefill_computed_tokens),
    ("inflight:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
     lambda s: s.prefix_cache_queries),
    ("inflight:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
     lambda s: s.prefix_cache_hits),
    ("inflight:external_prefix_cache_queries_total", "Prompt tokens looked up in the host KV tier (past the "
     "device's prefix-cache hits), vLLM's external prefix cache.", lambda s: s.external_prefix_cache_queries),
    ("inflight:external_prefix_cache_hits_total", "Prompt tokens found in the host KV tier (copied back, not "
     "recomputed).", lambda s: s.external_prefix_cache_hits),
    ("inflight:kv_offload_stored_blocks_total", "KV blocks copied from the device to the host tier.",
     lambda s: s.kv_offload_stored_blocks),
    ("inflight:kv_offload_loaded_blocks_total", "KV blocks copied from the host tier back to the device.",
     lambda s: s.kv_offload_loaded_blocks),
    ("inflight:kv_offload_bytes_total", "Bytes copied between the device and the host KV tier, both ways.",
     lambda s: s.kv_offload_bytes),
    ("inflight:kv_offload_dropped_blocks_total", "Evicted device blocks the host tier could not take (every "
     "slot held by the step's copy-ins).", lambda s: s.kv_offload_dropped_blocks),
    ("inflight:spec_decode_num_drafts_total", "Speculative decoding: sequence-steps that proposed drafts.",
     lambda s: s.spec_num_drafts),
    ("inflight:spec_decode_num_draft_tokens_total", "Speculative decoding: draft tokens proposed.",
     lambda s: s.spec_num_draft_tokens),
    ("inflight:spec_decode_num_accepted_tokens_total", "Speculative decoding: draft tokens the model kept.",
     lambda s: s.spec_num_accepted_tokens),
)

_DEVICE_BUSY = "inflight:device_busy_seconds"  # a counter: exposed as inflight:device_busy_seconds_total
# vLLM's name first: the Gateway API Inference Extension's picker reads it by default (--lora-info-metric)
LORA_INFO_METRICS = ("vllm:lora_requests_info", "inflight:lora_requests_info")


class SampleGuard:
    """Reported values as samples: one that no float can hold (an integer past ~1.8e308, a
    non-number) is left out of the scrape and logged, once per metric, never raised."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def sample(self, name: str, value: object) -> float | None:
        """``value`` as a sample for the metric ``name`` (NaN and infinities included, which the
        exposition format writes), or None."""
        if isinstance(value, (int, float)):
            try:
                return float(value)
            except OverflowError:
                pass
        self.warn(name, f"a {type(value).__name__} value that no float can hold")
        return None

    def warn(self, name: str, why: object) -> None:
        if name not in self._warned:
            self._warned.add(name)
            logger.warning("/metrics leaves out %s: %s", name, str(why)[:200])


class _EngineStatsCollector(Collector):
    """Engine gauges and counters from a fresh ``EngineStats`` at each scrape."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None],
                 get_config: Callable[[], EngineConfig | None] | None = None) -> None:
        self._model_name = model_name
        self._get_stats = get_stats
        self._get_config = get_config
        self._guard = SampleGuard()

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._get_stats()
        except Exception as exc:  # noqa: BLE001 - a scrape must answer whatever the snapshot does
            self._guard.warn("the engine stats", exc)
            return
        if stats is None:  # still loading
            return
        for name, doc, value in _GAUGES:
            sample = self._sample(name, value, stats)
            if sample is not None:
                gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
                gauge.add_metric([self._model_name], sample)
                yield gauge
        for name, doc, value in _COUNTERS:
            sample = self._sample(name, value, stats)
            if sample is not None:
                counter = CounterMetricFamily(name, doc, labels=["model_name"])
                counter.add_metric([self._model_name], sample)
                yield counter
        if stats.device_busy_seconds is not None:  # measured: its rate is the device's utilisation (NVML's)
            sample = self._sample(_DEVICE_BUSY, lambda s: s.device_busy_seconds, stats)
            if sample is not None:
                busy = CounterMetricFamily(_DEVICE_BUSY, "Seconds the device spent executing steps; "
                                           "rate() of it is the device's utilisation (NVML's).", labels=["model_name"])
                busy.add_metric([self._model_name], sample)
                yield busy
        yield from self._guarded("the per-position acceptance counts", lambda: [self._per_position(stats)])
        yield from self._guarded("the LoRA info", lambda: self._lora_info(stats))
        if stats.kv_group_names:
            yield from self._guarded("the KV group blocks", lambda: [self._kv_groups(stats)])
        tenants = stats.tenants
        if tenants is not None:
            yield from self._guarded("the tenant metrics",
                                     lambda: list(_tenant_metrics(self._model_name, tenants, self._guard)))

    def _per_position(self, stats: EngineStats) -> Metric:
        name = "inflight:spec_decode_num_accepted_tokens_per_pos"
        per_position = CounterMetricFamily(
            name, "Speculative decoding: draft tokens kept at each draft position (0 = first).",
            labels=["model_name", "position"])  # fmt: skip
        for position, count in enumerate(stats.spec_accepted_per_position):
            sample = self._guard.sample(name, count)
            if sample is not None:
                per_position.add_metric([self._model_name, str(position)], sample)
        return per_position

    def _kv_groups(self, stats: EngineStats) -> Metric:
        """Per-group KV tables (docs/kv-groups.md): the pool blocks each group's tables hold."""
        name = "inflight:kv_blocks_held"
        held = GaugeMetricFamily(name, "KV-cache pool blocks held, per attention group (models with per-group "
                                 "KV tables only).", labels=["model_name", "group"])
        for group, count in zip(stats.kv_group_names, stats.kv_blocks_held_by_group, strict=True):
            sample = self._guard.sample(name, count)
            if sample is not None:
                held.add_metric([self._model_name, group], sample)
        return held

    def _lora_info(self, stats: EngineStats) -> list[Metric]:
        """vLLM's ``lora_requests_info`` (LoRA on only): one series, valued the scrape's time."""
        config = self._get_config() if self._get_config is not None else None
        if config is None or not config.enable_lora:
            return []
        labels = [str(config.max_loras), ",".join(stats.running_lora_adapters), ",".join(stats.waiting_lora_adapters)]
        families = []
        for name in LORA_INFO_METRICS:
            info = GaugeMetricFamily(name, "Running stats on LoRA requests: the adapters of running and waiting "
                                     "requests, and max_loras (value: the time of the scrape).",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric(labels, time.time())
            families.append(info)
        return families

    def _sample(self, name: str, read: Callable[[EngineStats], object], stats: EngineStats) -> float | None:
        """``read(stats)`` as a sample, or None (logged once) when it cannot be one."""
        try:
            value = read(stats)
        except Exception as exc:  # noqa: BLE001 - one bad field must not fail the scrape
            self._guard.warn(name, exc)
            return None
        return self._guard.sample(name, value)

    def _guarded(self, name: str, build: Callable[[], list[Metric]]) -> list[Metric]:
        """``build()``'s families, or none (logged once) if building them fails."""
        try:
            return build()
        except Exception as exc:  # noqa: BLE001 - one bad family must not fail the scrape
            self._guard.warn(name, exc)
            return []


# (name, help, family, TenantStats column): the fair policy's per-tenant series.
_TENANT_METRICS: tuple[tuple[str, str, type[GaugeMetricFamily | CounterMetricFamily], str], ...] = (
    ("inflight:tenant_num_requests_running", "Requests in the running batch, per tenant.",
     GaugeMetricFamily, "num_running"),
    ("inflight:tenant_num_requests_waiting", "Requests waiting for admission, per tenant.",
     GaugeMetricFamily, "num_waiting"),
    ("inflight:tenant_prompt_tokens_total", "Prompt tokens (prefix-cache hits included), per tenant.",
     CounterMetricFamily, "prompt_tokens"),
    ("inflight:tenant_generation_tokens_total", "Tokens generated, per tenant.",
     CounterMetricFamily, "generation_tokens"),
)


def _tenant_metrics(model_name: str, tenants: TenantStats, guard: SampleGuard) -> Iterator[Metric]:
    """One series per tenant label. The engine has chosen and bounded the labels
    (inflight.runtime.core.tenant_stats: names from --metrics-tenants, keyed digests, "other"), so
    none holds client text or names a tenant the operator did not; prometheus_client escapes them."""
    for name, doc, family, column in _TENANT_METRICS:
        metric = family(name, doc, labels=["model_name", "tenant"])
        for label, value in zip(tenants.labels, getattr(tenants, column), strict=True):
            sample = guard.sample(name, value)
            if sample is not None:
                metric.add_metric([model_name, label], sample)
        yield metric


MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's name; spawned front ends inherit it


def enable_multiprocess(directory: str) -> None:
    """Make this process's request metrics live in ``directory``'s files, shared with the other
    front ends. Call before any :class:`ServerMetrics` is made: prometheus_client chooses where
    a metric keeps its values when the metric is created (``values.ValueClass``, read from the
    environment when it is imported, which here may be before the server knew the count)."""
    os.environ[MULTIPROC_DIR_ENV] = directory
    values.ValueClass = values.MultiProcessValue()


def multiprocess_dir() -> str | None:
    """The shared metrics directory :func:`enable_multiprocess` set, if it did, in this process."""
    directory = os.environ.get(MULTIPROC_DIR_ENV)
    if directory is None or values.ValueClass is values.MutexValue:
        return None
    return directory


class ServerMetrics:
    """All metrics of one app. ``get_stats`` returns the engine's snapshot or ``None``.
    ``shared_dir``: the multiprocess directory of several front ends (see the module
    docstring); None for one front end, whose figures live in this object alone.
    ``max_model_len``: the loaded engine's context length (the token-count buckets run up to it),
    read at the first finished request; None only where no request is ever observed.
    ``get_config``: the live engine config (None while loading), for the LoRA info metric."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats | None],
                 shared_dir: str | None = None, max_model_len: Callable[[], int] | None = None,
                 get_config: Callable[[], EngineConfig | None] | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, get_stats, get_config))
        if shared_dir is not None:
            if values.ValueClass is values.MutexValue:
                raise RuntimeError("shared metrics need enable_multiprocess() before the metrics are made")
            MultiProcessCollector(self.registry, path=shared_dir)
        add_process_collectors(self.registry, shared_dir)
        # With a shared directory the scrape reads every process's files: the objects below only
        # write theirs (registered nowhere, or each process's own would count twice).
        own = self.registry if shared_dir is None else None
        self.requests = RequestHistograms(model_name, own, max_model_len)
        self.success = Counter("inflight:request_success_total",
                               "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=own)
        self._token_gaps: list[float] = []  # observed in bulk: observe_token_gap
        # one labelled child per finish reason, made once: .labels() per request costs a lock,
        # label checks and a lookup (as the histograms' children, request_metrics.py)
        self._finished: dict[str, Counter] = {}
        self.rejected = Counter("inflight:request_rejected_total",
                                "Requests refused before running, by reason.",
                                ["model_name", "reason"], registry=own)

    def observe_step(self, num_tokens: int) -> None:
        """Called from the engine thread after each step (prometheus_client is thread-safe)."""
        self.requests.iteration_tokens.observe(num_tokens)

    def observe_token_gap(self, seconds: float) -> None:
        """One gap between two deliveries of a request. Gaps are observed in bulk: the first of a
        batch asks the running event loop to observe them all once the callbacks it already has
        ready (the other streams of the same step) have run; without a running loop at once."""
        pending = self._token_gaps
        pending.append(seconds)
        if len(pending) == 1:
            try:
                asyncio.get_running_loop().call_soon(self.flush_token_gaps)
            except RuntimeError:  # no loop in this thread
                self.flush_token_gaps()

    def flush_token_gaps(self) -> None:
        """Observe the gaps not observed yet (a scrape calls it first)."""
        gaps, self._token_gaps = self._token_gaps, []
        observe_many(self.requests.itl, gaps)

    def observe_finished(self, out: RequestOutput, times: RequestTimes, max_tokens: int | None = None,
                         siblings: Sequence[Choice] = ()) -> None:
        """One finished engine request (one choice): ``out`` its last output, ``max_tokens`` its
        max_tokens parameter, ``siblings`` the choices of its prompt when it asked for ``n`` > 1
        (this one included, already marked finished): the per-prompt figures are observed with
        the last of them."""
        self._count_finished(out.finish_reason or "abort")
        self.requests.observe(out, times, max_tokens, siblings)

    def observe_aborted(self) -> None:
        """One engine request (one choice) aborted before it finished (client gone, cut)."""
        self._count_finished("abort")

    def _count_finished(self, reason: str) -> None:
        child = self._finished.get(reason)
        if child is None:
            child = self._finished[reason] = self.success.labels(self.model_name, reason)
        child.inc()

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        self.flush_token_gaps()
        return generate_latest(self.registry)
