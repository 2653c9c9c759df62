"""The autoscaling decision: a pure function (observations, policy, history, now) -> decision.

HPA-like. The usage ratio is ``max(mean_kv / target_kv, mean_queue / target_queue,
mean_ttft / target_ttft)`` over the ready pods, and the recommendation is ``ceil(ready * ratio)``;
the third signal (seconds of TTFT backlog: a pod's queued prompt tokens over its measured
prefill rate) only with a TTFT target, and a pod that has not measured a prefill rate yet
gives it no signal (0 s), never infinity. The reason names the signal that won, and the
message carries every signal's value and target. Inside the tolerance band
(|ratio - 1| <= tolerance) the current count is kept. Ready pods without fresh metrics are
counted conservatively: as zero load when the others point up, as exactly on target when
they point down. While pods are pending (desired but not ready), no further scale-up.
Stabilization: the decision is the lowest recommendation of the scale-up window and the
highest of the scale-down window (so a scale-down happens only once every recommendation
in the window agrees), then clamped to [min, max].

Owns nothing but arithmetic: no clock, no I/O; the caller keeps the history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_TOLERANCE = 0.1
MAX_MESSAGE_CHARS = 240  # a recommendation's message as the status keeps it


@dataclass(frozen=True, slots=True)
class PodMetrics:
    """One ready pod's last scrape; ``None`` fields mean no fresh metrics."""

    name: str
    kv_cache_usage: float | None
    num_waiting: float | None
    prefill_backlog_tokens: float | None = None  # tokens still to be prefilled
    prefill_tokens_per_second: float | None = None  # measured prefill rate; 0: none measured yet

    @property
    def ttft_backlog_seconds(self) -> float | None:
        """Queued prompt tokens over the measured prefill rate; None without a measured rate."""
        backlog, rate = self.prefill_backlog_tokens, self.prefill_tokens_per_second
        if backlog is None or rate is None or not rate > 0.0 or not math.isfinite(rate):
            return None
        return max(0.0, backlog) / rate


@dataclass(frozen=True, slots=True)
class Observations:
    current_replicas: int  # the Deployment's spec.replicas
    ready: tuple[PodMetrics, ...]  # one entry per ready pod
    num_pending: int = 0  # desired pods not ready yet


@dataclass(frozen=True, slots=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target_kv_cache_usage: float
    target_queue_depth: float
    scale_up_window_s: float = 0.0
    scale_down_window_s: float = 300.0
    tolerance: float = DEFAULT_TOLERANCE
    target_ttft_seconds: float | None = None  # the TTFT-backlog signal; None: off


@dataclass(frozen=True, slots=True)
class Recommendation:
    time: float
    replicas: int
    reason: str = ""  # the raw recommendation's reason (the signal that won) and message
    message: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    reason: str  # CamelCase code, e.g. ScaleUpQueue
    message: str
    recommendation: Recommendation  # append to history
    kv_cache_usage: float | None = None  # means over pods with metrics (for status)
    queue_depth: float | None = None
    ttft_backlog_seconds: float | None = None  # None: no target, or no pod measured a rate


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(frozen=True, slots=True)
class _Load:
    """The signals' means over the ready pods."""

    kv: float
    queue: float
    ttft: float | None  # None: no TTFT target, or no pod has measured a prefill rate


def _ttft(pod: PodMetrics) -> float:
    """A measured pod's TTFT backlog in seconds; 0 (no signal) before it measured a rate."""
    seconds = pod.ttft_backlog_seconds
    return 0.0 if seconds is None else seconds


def _ratio(load: _Load, policy: Policy) -> tuple[float, str]:
    """The largest signal/target ratio and the signal's name (ties: KvCache, Queue, Ttft)."""
    candidates = [(load.kv / policy.target_kv_cache_usage, "KvCache"),
                  (load.queue / policy.target_queue_depth, "Queue")]
    if policy.target_ttft_seconds is not None and load.ttft is not None:
        candidates.append((load.ttft / policy.target_ttft_seconds, "Ttft"))
    return max(candidates, key=lambda c: c[0])  # the first of equals


def _measured_load(measured: list[PodMetrics], policy: Policy) -> _Load:
    kv = _mean([p.kv_cache_usage for p in measured if p.kv_cache_usage is not None]) or 0.0
    queue = _mean([p.num_waiting for p in measured if p.num_waiting is not None]) or 0.0
    ttft: float | None = None
    if policy.target_ttft_seconds is not None and any(p.ttft_backlog_seconds is not None for p in measured):
        ttft = _mean([_ttft(p) for p in measured])
    return _Load(kv, queue, ttft)


def _signals(pods: tuple[PodMetrics, ...], missing_as: str, policy: Policy, ttft_on: bool) -> _Load:
    """Means over all ready pods; pods without metrics as zero or as on target."""
    kv: list[float] = []
    queue: list[float] = []
    ttft: list[float] = []
    zero = missing_as == "zero"
    for pod in pods:
        if pod.kv_cache_usage is None or pod.num_waiting is None:
            kv.append(0.0 if zero else policy.target_kv_cache_usage)
            queue.append(0.0 if zero else policy.target_queue_depth)
            ttft.append(0.0 if zero or policy.target_ttft_seconds is None else policy.target_ttft_seconds)
        else:
            kv.append(pod.kv_cache_usage)
            queue.append(pod.num_waiting)
            ttft.append(_ttft(pod))
    return _Load(sum(kv) / len(kv), sum(queue) / len(queue), sum(ttft) / len(ttft) if ttft_on else None)


def _detail(load: _Load, policy: Policy) -> str:
    detail = f"kv {load.kv:.2f}/{policy.target_kv_cache_usage:g}, queue {load.queue:.2f}/{policy.target_queue_depth:g}"
    if policy.target_ttft_seconds is not None:
        target = policy.target_ttft_seconds
        detail += (f", ttft backlog n/a (no prefill rate measured; target {target:g}s)" if load.ttft is None
                   else f", ttft backlog {load.ttft:.2f}s/{target:g}s")
    return detail


def recommend(obs: Observations, policy: Policy) -> tuple[int, str, str]:
    """The raw recommendation before stabilization and clamping: (replicas, reason, message)."""
    current = obs.current_replicas
    measured = [p for p in obs.ready if p.kv_cache_usage is not None and p.num_waiting is not None]
    if not obs.ready:
        return current, "NoReadyPods", "no ready pods to measure; holding"
    if not measured:
        return current, "NoMetrics", f"none of {len(obs.ready)} ready pods returned metrics; holding"
    load = _measured_load(measured, policy)
    ratio, signal = _ratio(load, policy)
    if len(measured) < len(obs.ready):  # recompute with the missing pods counted conservatively
        load = _signals(obs.ready, "zero" if ratio > 1 else "target", policy, load.ttft is not None)
        new_ratio, signal = _ratio(load, policy)
        if (ratio > 1) != (new_ratio > 1):
            return current, "WithinTolerance", "pods without metrics cancel the signal; holding"
        ratio = new_ratio
    detail = _detail(load, policy)
    if abs(ratio - 1.0) <= policy.tolerance:
        return current, "WithinTolerance", f"ratio {ratio:.2f} within tolerance ({detail})"
    wanted = max(1, math.ceil(len(obs.ready) * ratio - 1e-9))
    if wanted > current and obs.num_pending > 0:
        return current, "PendingPods", f"{obs.num_pending} pod(s) still pending; not scaling up ({detail})"
    if wanted > current:
        return wanted, f"ScaleUp{signal}", f"ratio {ratio:.2f} by {signal} ({detail})"
    if wanted < current:
        return wanted, "ScaleDown", f"ratio {ratio:.2f} by {signal} ({detail})"
    return current, "Steady", f"ratio {ratio:.2f} by {signal} ({detail})"


def decide(
    obs: Observations, policy: Policy, history: tuple[Recommendation, ...], now: float
) -> Decision:
    """Recommend, stabilize over ``history`` (earlier recommendations), clamp to [min, max]."""
    raw, reason, message = recommend(obs, policy)
    rec = Recommendation(time=now, replicas=raw, reason=reason, message=message[:MAX_MESSAGE_CHARS])
    current = obs.current_replicas
    desired = raw
    if raw > current:
        window = [r.replicas for r in history if now - r.time < policy.scale_up_window_s] + [raw]
        desired = max(current, min(window))
        if desired < raw:
            reason, message = "StabilizingUp", f"{message}; held by the scale-up window"
    elif raw < current:
        window = [r.replicas for r in history if now - r.time < policy.scale_down_window_s] + [raw]
        desired = min(current, max(window))
        if desired > raw:
            reason, message = "StabilizingDown", f"{message}; held by the scale-down window"
    clamped = min(max(desired, policy.min_replicas), policy.max_replicas)
    if clamped != desired:
        bound = "minReplicas" if clamped > desired else "maxReplicas"
        message = f"{message}; clamped to {bound} {clamped}"
        if clamped == current or not reason.startswith(("ScaleUp", "ScaleDown")):
            reason = "ClampedMin" if bound == "minReplicas" else "ClampedMax"
        desired = clamped
    measured = [p for p in obs.ready if p.kv_cache_usage is not None and p.num_waiting is not None]
    ttft = _measured_load(measured, policy).ttft if measured else None
    return Decision(
        desired=desired,
        reason=reason,
        message=message,
        recommendation=rec,
        kv_cache_usage=_mean([p.kv_cache_usage for p in measured if p.kv_cache_usage is not None]),
        queue_depth=_mean([p.num_waiting for p in measured if p.num_waiting is not None]),
        ttft_backlog_seconds=ttft,
    )


MAX_HISTORY = 256  # entries kept after compaction (2 per distinct replica count suffice)


def prune(
    history: tuple[Recommendation, ...], policy: Policy, now: float, compact: bool = True
) -> tuple[Recommendation, ...]:
    """Drop recommendations older than both windows, then (``compact``) every one a later one
    makes redundant: what ``decide`` takes from a window is its minimum (scale-up) and maximum
    (scale-down), and a later entry stays in every window at least as long as an earlier one,
    so an entry with a later one at least as high and a later one at most as low never decides
    anything. What is left is at most two entries per distinct replica count (bounded by
    MAX_HISTORY, the oldest dropped), whatever the interval and the windows: the status that
    carries it stays small."""
    keep = max(policy.scale_up_window_s, policy.scale_down_window_s)
    live = tuple(r for r in history if now - r.time < keep)
    if not compact:
        return live
    out: list[Recommendation] = []
    highest, lowest = -math.inf, math.inf  # over the later entries
    for rec in reversed(live):
        if rec.replicas > highest or rec.replicas < lowest:
            out.append(rec)
        highest, lowest = max(highest, rec.replicas), min(lowest, rec.replicas)
    out.reverse()
    return tuple(out[-MAX_HISTORY:])
