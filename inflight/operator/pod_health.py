"""Why the runtime pods are not running, read from the pods and the Deployment: the causes
that become the ``Degraded`` condition's reason and message.

Owns the mapping from Kubernetes' own signals to one reason an SRE can act on:
``Unschedulable`` (``0/3 nodes are available: 3 Insufficient nvidia.com/gpu``), image pull
errors (``ErrImagePull``, ``ImagePullBackOff``, ``InvalidImageName``), ``CrashLoopBackOff``
(with the last exit: ``OOMKilled``, exit code), container config errors, and the Deployment's
``ReplicaFailure`` (``FailedCreate``: a quota, a Pod Security refusal) and
``ProgressDeadlineExceeded``, and a pod stuck in ``ContainerCreating`` (or with init containers
not started) past ``CREATING_THRESHOLD_SECONDS``: the reason is then the kubelet's or the
attach/detach controller's Event on the pod (``FailedAttachVolume`` with its ``Multi-Attach
error``, ``FailedMount``, ``FailedMapVolume``), which the pod's own status never shows.
Pure functions over the objects as the API server returns them; ``pod_events`` reads the
Events. Knows nothing about I/O.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

WAITING_FAILURES = (  # container waiting reasons that will not fix themselves
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
)
MESSAGE_LIMIT = 300
# A pod still creating its containers after this long is read for volume Events (attaching a
# cloud disk takes a minute or so; a Multi-Attach error never resolves by itself).
CREATING_THRESHOLD_SECONDS = 120.0
CREATING_REASONS = ("ContainerCreating", "PodInitializing")
VOLUME_EVENT_REASONS = ("FailedAttachVolume", "FailedMount", "FailedMapVolume")


@dataclass(frozen=True, slots=True)
class Failure:
    reason: str  # CamelCase, Kubernetes' own word where there is one
    message: str


def pod_failure(pod: dict[str, Any]) -> Failure | None:
    """The first thing keeping this pod from running, or ``None``."""
    name = (pod.get("metadata") or {}).get("name", "?")
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("reason") == "Unschedulable":
            return Failure("Unschedulable", _clip(f"pod {name}: {cond.get('message') or 'cannot be scheduled'}"))
    statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason not in WAITING_FAILURES:
            continue
        detail = waiting.get("message") or ""
        last = ((cs.get("lastState") or {}).get("terminated")) or {}
        if reason == "CrashLoopBackOff" and last:
            detail = f"last exit: {last.get('reason') or 'Error'} (code {last.get('exitCode')})" + (
                f": {last['message']}" if last.get("message") else "")
        container = cs.get("name", "?")
        return Failure(reason, _clip(f"pod {name}, container {container}: {detail or reason}"))
    return None


def deployment_failure(deployment: dict[str, Any]) -> Failure | None:
    """``ReplicaFailure`` (pods the ReplicaSet could not create) or a stalled rollout."""
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return Failure(cond.get("reason") or "FailedCreate", _clip(cond.get("message") or "pods cannot be created"))
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Failure("ProgressDeadlineExceeded", _clip(cond.get("message") or "the rollout stalled"))
    return None


def failure(deployment: dict[str, Any], pods: list[dict[str, Any]],
            events: Sequence[dict[str, Any]] = ()) -> Failure | None:
    """What the ``Degraded`` condition reports: the Deployment's own failure first (no pod
    exists to say anything), else the first failing pod's, with a count when there are more.
    ``events``: Events of pods stuck creating (``stuck_creating``), read by ``pod_events``."""
    if (found := deployment_failure(deployment)) is not None:
        return found
    failures = [f for p in pods if (f := pod_failure(p) or volume_failure(p, events)) is not None]
    if not failures:
        return None
    first = failures[0]
    more = len(failures) - 1
    return Failure(first.reason, first.message + (f" (and {more} more pod(s) failing)" if more else ""))


def stuck_creating(pod: dict[str, Any], now: float, threshold_s: float = CREATING_THRESHOLD_SECONDS) -> bool:
    """Whether the pod was scheduled more than ``threshold_s`` ago and a container still waits
    in ``ContainerCreating``/``PodInitializing`` (volumes not attached or mounted, typically)."""
    status = pod.get("status") or {}
    statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    waiting = any(((cs.get("state") or {}).get("waiting") or {}).get("reason") in CREATING_REASONS
                  for cs in statuses)
    if not waiting and not (status.get("phase") == "Pending" and not statuses and _scheduled_at(pod) is not None):
        return False
    since = _scheduled_at(pod) or parse_time((pod.get("metadata") or {}).get("creationTimestamp"))
    return since is not None and now - since >= threshold_s


def volume_failure(pod: dict[str, Any], events: Sequence[dict[str, Any]]) -> Failure | None:
    """The newest volume Event (``VOLUME_EVENT_REASONS``) about this pod, as its failure."""
    meta = pod.get("metadata") or {}
    mine = [e for e in events if e.get("reason") in VOLUME_EVENT_REASONS and _about(e, meta)]
    if not mine:
        return None
    newest = max(mine, key=_event_time)
    return Failure(newest["reason"], _clip(f"pod {meta.get('name', '?')}: {newest.get('message') or newest['reason']}"))


def parse_time(value: Any) -> float | None:
    """An RFC 3339 timestamp (``2026-01-02T03:04:05Z``, optionally with fractions) as epoch seconds."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _scheduled_at(pod: dict[str, Any]) -> float | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "True":
            return parse_time(cond.get("lastTransitionTime"))
    return None


def _about(event: dict[str, Any], pod_meta: dict[str, Any]) -> bool:
    obj = event.get("involvedObject") or event.get("regarding") or {}
    if obj.get("kind", "Pod") != "Pod" or obj.get("name") != pod_meta.get("name"):
        return False
    return not obj.get("uid") or not pod_meta.get("uid") or obj["uid"] == pod_meta["uid"]


def _event_time(event: dict[str, Any]) -> float:
    series = event.get("series") or {}
    for value in (series.get("lastObservedTime"), event.get("lastTimestamp"), event.get("eventTime"),
                  event.get("firstTimestamp"), (event.get("metadata") or {}).get("creationTimestamp")):
        if (parsed := parse_time(value)) is not None:
            return parsed
    return 0.0


def _clip(text: str) -> str:
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."
