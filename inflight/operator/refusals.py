"""What the cluster (or the spec parser) said no to: one value, its condition, its Event and its retry delay.

Owns ``Refusal`` and the vocabulary an SRE pages on (``docs/operator-conditions.md``): the
``Degraded`` condition's reasons ``InvalidSpec`` (the spec parser refused the spec; nothing was
sent), ``ApplyRefused`` (the API server answered 4xx: a policy webhook's or a quota's 403, a
409 conflict, a 400/422 invalid object) and ``ApplyFailed`` (no usable answer: a 5xx or a
timeout). 400 and 422 are about the object itself: retrying the same spec cannot help, so they
wait for the next spec change; every other refusal is retried with exponential backoff
(``retry_delay``). An Event is posted once per distinct refusal (``Refusal.key``), not once per
retry. Pure values and arithmetic: no I/O, no kopf, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.operator.kube import KubeError
from inflight.operator.status import Condition

PERMANENT_CODES = (400, 422)  # the object is invalid: only a spec change can help


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refusal: the condition reason, the API server's answer and what it was about."""

    reason: str  # InvalidSpec | ApplyRefused | ApplyFailed | LeaderWorkerSetMissing
    code: int  # the HTTP status; 0: no answer (timeout, connection) or not from the API server
    api_reason: str  # the Status object's reason: Forbidden, Conflict, Invalid, Timeout, ...
    target: str  # "create deployments/default/x"; "" for InvalidSpec
    message: str  # the API server's (or the parser's) message
    generation: int | None  # the CR generation that was being applied
    permanent: bool  # True: not retried until the spec changes
    during: str = "spec"  # "spec": applying a spec change; "repair": putting a child back

    @property
    def key(self) -> tuple[object, ...]:
        """Same key, same refusal: one Event for all its retries."""
        return (self.reason, self.code, self.api_reason, self.target, self.message, self.generation, self.during)

    def text(self) -> str:
        if self.reason == "InvalidSpec":
            return self.message
        answer = f"HTTP {self.code} {self.api_reason}".strip() if self.code else (self.api_reason or "no answer")
        what = "applying generation" if self.during == "spec" else "repairing the children of generation"
        then = ("not retried until the spec changes" if self.permanent
                else "retried with backoff; the last spec that applied keeps running")
        return f"{answer} on {self.target} while {what} {self.generation}: {self.message} ({then})"

    def condition(self) -> Condition:
        return Condition("Degraded", True, self.reason, self.text())


def invalid_spec(message: str, generation: int | None) -> Refusal:
    return Refusal("InvalidSpec", 0, "", "", message, generation, permanent=True)


def from_error(exc: KubeError, generation: int | None, during: str = "spec", message: str = "",
               reason: str = "") -> Refusal:
    """The refusal an API error stands for (``message`` replaces the server's, e.g. with a hint;
    ``reason`` the status code's, e.g. LeaderWorkerSetMissing for a 404 on that kind)."""
    permanent = exc.status in PERMANENT_CODES
    reason = reason or ("ApplyRefused" if 400 <= exc.status < 500 else "ApplyFailed")
    api_reason = exc.reason or {403: "Forbidden", 409: "Conflict", 422: "Invalid"}.get(exc.status, "")
    return Refusal(reason, exc.status, api_reason, f"{exc.method} {exc.what}", message or exc.message,
                   generation, permanent, during)


def retry_delay(retries: int, base_s: float, max_s: float) -> float:
    """Seconds before retry number ``retries + 1``: ``base * 2**retries``, at most ``max_s``."""
    return float(min(max_s, base_s * 2 ** min(retries, 30)))
