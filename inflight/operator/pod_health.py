"""Why the runtime pods are not running, read from the pods and the Deployment: the causes
that become the ``Degraded`` condition's reason and message.

Owns the mapping from Kubernetes' own signals to one reason an SRE can act on:
``Unschedulable`` (``0/3 nodes are available: 3 Insufficient nvidia.com/gpu``), image pull
errors (``ErrImagePull``, ``ImagePullBackOff``, ``InvalidImageName``), ``CrashLoopBackOff``
(with the last exit: ``OOMKilled``, exit code), container config errors, and the Deployment's
``ReplicaFailure`` (``FailedCreate``: a quota, a Pod Security refusal) and
``ProgressDeadlineExceeded``. Pure functions over the objects as the API server returns them;
knows nothing about I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WAITING_FAILURES = (  # container waiting reasons that will not fix themselves
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff",
    "CreateContainerConfigError", "CreateContainerError", "RunContainerError",
)
MESSAGE_LIMIT = 300


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


def failure(deployment: dict[str, Any], pods: list[dict[str, Any]]) -> Failure | None:
    """What the ``Degraded`` condition reports: the Deployment's own failure first (no pod
    exists to say anything), else the first failing pod's, with a count when there are more."""
    if (found := deployment_failure(deployment)) is not None:
        return found
    failures = [f for p in pods if (f := pod_failure(p)) is not None]
    if not failures:
        return None
    first = failures[0]
    more = len(failures) - 1
    return Failure(first.reason, first.message + (f" (and {more} more pod(s) failing)" if more else ""))


def _clip(text: str) -> str:
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."
