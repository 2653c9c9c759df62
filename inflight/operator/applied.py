"""What the operator last applied to a child object, and what follows from it: deletions and drift.

A JSON merge patch only changes the keys it names, so a key the operator stopped setting (a
``nodeSelector`` entry, a pod annotation) would stay for ever. Like ``kubectl apply``, each
child carries the operator's last applied content in the annotation
``inflight.dev/last-applied``; the next apply sets every key that was applied then and is gone
now to ``null`` (a three-way merge). The same record tells whether a live object drifted from
what the operator applied (a hand edit, or a deleted child): every applied value must still be
there, fields the API server added aside. ``fingerprint`` hashes the owned fields as the API
server answered the operator's write, so that a mutating webhook's additions (a sidecar in a
list) are part of what was applied and cause no re-apply loop. Pure functions; knows nothing
about HTTP.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

ANNOTATION = "inflight.dev/last-applied"


def without_nulls(value: Any) -> Any:
    """``value`` with every ``None`` (a merge patch's "delete this") dropped, recursively."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def record(patch: dict[str, Any]) -> str:
    """The annotation's text for what ``patch`` sets (canonical JSON, without the annotation)."""
    content = without_nulls(copy.deepcopy(patch))
    annotations = (content.get("metadata") or {}).get("annotations") or {}
    annotations.pop(ANNOTATION, None)
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


def last_applied(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the operator last applied to ``obj`` (None when unknown)."""
    text = (((obj or {}).get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def deletions(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A merge patch that deletes every key of ``old`` absent from ``new`` (maps only; lists
    are replaced whole by a merge patch anyway)."""
    out: dict[str, Any] = {}
    for key, old_value in old.items():
        if key not in new or new[key] is None:
            out[key] = None
        elif isinstance(old_value, dict) and isinstance(new[key], dict):
            nested = deletions(old_value, new[key])
            if nested:
                out[key] = nested
    return out


def with_deletions(patch: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """``patch`` plus the deletions since ``previous`` plus the new record annotation.
    ``spec.replicas`` is never deleted: when the operator stops setting it, an autoscaler (its
    own, an HPA) owns it, and a deletion would default it to 1."""
    merged = copy.deepcopy(patch)
    if previous is not None:
        gone = deletions(previous, without_nulls(patch))
        if isinstance(gone.get("spec"), dict) and "replicas" in gone["spec"]:
            del gone["spec"]["replicas"]
            if not gone["spec"]:
                del gone["spec"]
        _merge_missing(merged, gone)
    merged.setdefault("metadata", {}).setdefault("annotations", {})[ANNOTATION] = record(patch)
    return merged


def _merge_missing(target: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if key not in target:
            target[key] = value
        elif isinstance(value, dict) and isinstance(target[key], dict):
            _merge_missing(target[key], value)


def drifted(live: dict[str, Any] | None, applied: dict[str, Any] | None) -> bool:
    """Whether ``live`` lost anything of ``applied``: missing, or a value changed (extra
    fields the API server or others added do not count)."""
    if live is None:
        return True
    if applied is None:
        return False  # applied before records existed: the next change of spec records it
    return not _contains(live, applied)


def _contains(live: Any, applied: Any) -> bool:
    if isinstance(applied, dict):
        return isinstance(live, dict) and all(k in live and _contains(live[k], v) for k, v in applied.items())
    if isinstance(applied, list):
        return (isinstance(live, list) and len(live) == len(applied)
                and all(_contains(lv, av) for lv, av in zip(live, applied, strict=True)))  # fmt: skip
    return live == applied


_MISSING = "\x00missing"


def owned(live: Any, applied: Any) -> Any:
    """``live`` cut down to the keys ``applied`` sets (maps only; a list is kept whole, since a
    merge patch owns a list whole): the fields the operator owns, as they are now."""
    if isinstance(applied, dict):
        if not isinstance(live, dict):
            return _MISSING if live is None else live
        return {k: owned(live[k], v) if k in live else _MISSING for k, v in applied.items()}
    return live


def fingerprint(live: dict[str, Any] | None) -> str:
    """A hash of the fields ``live``'s own record (its last-applied annotation) says the operator
    owns, as they are in ``live``. Taken from the API server's answer to the operator's write, it
    includes what a mutating webhook or defaulting added there; a later change of it is someone
    else's edit (or a deletion), so re-applying on it cannot loop with the webhook."""
    shape = owned(live, last_applied(live)) if live is not None else None
    text = json.dumps([record_of(live), shape], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def record_of(live: dict[str, Any] | None) -> str | None:
    """The last-applied record's text on ``live`` (None when it has none)."""
    return (((live or {}).get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)


def is_drifted(live: dict[str, Any] | None, patch: dict[str, Any], key: str, written: dict[str, str],
               pending: bool = False) -> bool:
    """Whether ``live`` needs ``patch`` applied again. ``written``: fingerprints after the
    operator's own writes (set here when a child is first seen unchanged); ``pending``: a newer
    spec was refused part-way, so a child the operator wrote from it is left alone (re-applying
    the older spec there would flip it back and forth with every retry)."""
    if live is None:
        return True
    now = fingerprint(live)
    known = written.get(key)
    if record_of(live) != record(patch):  # rendered otherwise now, or edited away
        return not (pending and known == now)
    if known is None:  # first look since the operator started: compare by content once
        if drifted(live, without_nulls(patch)):
            return True
        written[key] = now
        return False
    return now != known
