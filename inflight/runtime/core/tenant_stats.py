"""Per-tenant counts for the ``fair`` scheduler policy, under labels that name nobody.

The unit counted is a tenant's group (:func:`inflight.runtime.core.fairness.tenant_group`: an API
key, a peer address, or a trusted gateway's tenant id; never a ``user`` field), and ``/metrics``
may be open to anyone, so a group is reported under a label that does not say who it is:

* the groups named in ``metrics_tenants`` (``--metrics-tenants``, :func:`parse_metrics_tenants`)
  each get a series under their own name, always present; when that list is given, every
  other group is counted under :data:`OTHER_TENANT`;
* without the list, a group gets a series under a keyed digest, ``t-<12 hex digits>`` (HMAC-SHA-256
  with a secret drawn per meter: a label cannot be matched against guessed names, and changes
  when the engine restarts). At most ``max_tenants`` (:data:`MAX_TRACKED_TENANTS`) such series:
  when all are held, the one idle longest (no request running or waiting at the last snapshot,
  nothing counted since) gives its series up to the newcomer, and its counts move into
  :data:`OTHER_TENANT`, so the slots are not first come for the life of the process; when none
  is idle the newcomer is counted under :data:`OTHER_TENANT`;
* the fair policy's overflow group (strangers beyond its tenant bound) is :data:`OTHER_TENANT`.

A scrape therefore holds at most ``max_tenants + 1`` series per metric (or the named ones + 1),
and never any text a client sent. The engine owns one :class:`TenantMeter`, counts tokens into
it as they are produced, and publishes :meth:`TenantMeter.snapshot` in ``EngineStats.tenants``
(the stats that already cross the process boundary each step); the front end only renders
those rows. Imports no torch; knows nothing about Prometheus or HTTP.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections import Counter
from collections.abc import Iterable

from inflight.runtime.core.fairness import OVERFLOW, SEPARATOR, tenant_group
from inflight.runtime.core.request import Request
from inflight.runtime.outputs import TenantStats

# At most this many digest-labelled tenants have a series of their own at once; the rest share
# "other". 64 keeps a scrape small (4 metrics x 65 series); each named tenant costs every scrape
# and every Prometheus server a series per metric.
MAX_TRACKED_TENANTS = 64
MAX_TENANT_LABEL_CHARS = 64  # the longest name --metrics-tenants accepts
OTHER_TENANT = "other"
HASHED_PREFIX = "t-"  # digest labels; no configured name may start so
_LABEL_CHARS = re.compile(r"[A-Za-z0-9_.:@+=-]+")  # what a configured name may hold


def parse_metrics_tenants(text: str | None) -> tuple[str, ...]:
    """The tenant names of ``--metrics-tenants`` (comma-separated), checked; () for none."""
    if text is None or not text.strip():
        return ()
    names = tuple(name.strip() for name in text.split(","))
    for name in names:
        if not name:
            raise ValueError(f"metrics_tenants {text!r} has an empty name; separate tenant names with commas.")
        if SEPARATOR in name:
            raise ValueError(f"metrics_tenants: {name!r} names a user within a tenant; name the tenant itself "
                             f"(the part before {SEPARATOR!r}: an API key's key:<digest>, addr:<peer>, or the "
                             "--tenant-header value).")
        if (len(name) > MAX_TENANT_LABEL_CHARS or not _LABEL_CHARS.fullmatch(name) or name == OTHER_TENANT
                or name.startswith(HASHED_PREFIX)):  # fmt: skip
            raise ValueError(f"metrics_tenants: {name[:80]!r} is not a usable label: at most "
                             f"{MAX_TENANT_LABEL_CHARS} of A-Z a-z 0-9 _ . : @ + = -, not {OTHER_TENANT!r}, "
                             f"not starting with {HASHED_PREFIX!r}.")
    if len(set(names)) != len(names):
        raise ValueError(f"metrics_tenants {text!r} names a tenant twice.")
    if len(names) > MAX_TRACKED_TENANTS:
        raise ValueError(f"metrics_tenants names {len(names)} tenants; at most {MAX_TRACKED_TENANTS} may have "
                         "series of their own.")
    return names


class TenantMeter:
    """Cumulative token counts per tenant label (see the module docstring)."""

    def __init__(self, named: Iterable[str] = (), max_tenants: int = MAX_TRACKED_TENANTS,
                 secret: bytes | None = None) -> None:  # fmt: skip
        self.named = tuple(named)
        self._named = frozenset(self.named)
        self.max_tenants = max_tenants
        self._secret = secrets.token_bytes(16) if secret is None else secret
        # label -> [prompt tokens, generation tokens]: the named ones, then digests as claimed
        self._counts: dict[str, list[int]] = {name: [0, 0] for name in self.named}
        self._other = [0, 0]
        self._seen: dict[str, int] = {}  # digest label -> the epoch it was last seen in
        self._epoch = 0  # snapshots taken
        self._digests: dict[str, str] = {}  # group -> digest label: a cache, bounded

    def _wanted(self, group: str) -> str:
        """The label ``group`` is reported under when it has a series."""
        if group in self._named:
            return group
        if self.named or group == OVERFLOW:
            return OTHER_TENANT
        label = self._digests.get(group)
        if label is None:
            digest = hmac.new(self._secret, group.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()
            label = HASHED_PREFIX + digest[:12]
            if len(self._digests) >= 4 * self.max_tenants:
                self._digests.clear()
            self._digests[group] = label
        return label

    def _label_group(self, group: str) -> str:
        """``group``'s label now, claiming (or recycling) a digest series when it has none."""
        label = self._wanted(group)
        if label == OTHER_TENANT or label in self._named:
            return label
        if label not in self._seen and not self._claim(label):
            return OTHER_TENANT
        self._seen[label] = self._epoch
        return label

    def _claim(self, label: str) -> bool:
        if len(self._seen) >= self.max_tenants:
            idle = [seen_label for seen_label, epoch in self._seen.items() if epoch < self._epoch]
            if not idle:
                return False
            oldest = min(idle, key=self._seen.__getitem__)
            del self._seen[oldest]
            prompt, generated = self._counts.pop(oldest)
            self._other[0] += prompt
            self._other[1] += generated
        self._seen[label] = self._epoch
        self._counts[label] = [0, 0]
        return True

    def label(self, tenant: str) -> str:
        """The label ``tenant``'s counts go under now (see the module docstring)."""
        return self._label_group(tenant_group(tenant))

    def count(self, tenant: str, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Add the prompt tokens of ``tenant``'s requests (counted at a request's first output
        token, prefix-cache hits included, as the engine-wide ``num_prompt_tokens``) and the
        tokens generated for it."""
        label = self.label(tenant)
        counts = self._other if label == OTHER_TENANT else self._counts[label]
        counts[0] += num_prompt_tokens
        counts[1] += num_generation_tokens

    def snapshot(self, running: Iterable[Request], waiting: Iterable[Request]) -> TenantStats:
        """Every label with a series ("other" last), with each one's requests running and
        waiting now. The groups with requests are marked seen before any series is claimed, so
        only a series idle at this snapshot is given up."""
        self._epoch += 1
        per_running = Counter(tenant_group(r.tenant) for r in running)
        per_waiting = Counter(tenant_group(r.tenant) for r in waiting)
        active = list((per_running | per_waiting).keys())
        for group in active:
            label = self._wanted(group)
            if label in self._seen:
                self._seen[label] = self._epoch
        num_running: Counter[str] = Counter()
        num_waiting: Counter[str] = Counter()
        for group in active:
            label = self._label_group(group)
            num_running[label] += per_running[group]
            num_waiting[label] += per_waiting[group]
        labels = (*self._counts, OTHER_TENANT)
        counts = {**self._counts, OTHER_TENANT: self._other}
        return TenantStats(
            labels=labels,
            num_running=tuple(num_running[label] for label in labels),
            num_waiting=tuple(num_waiting[label] for label in labels),
            prompt_tokens=tuple(counts[label][0] for label in labels),
            generation_tokens=tuple(counts[label][1] for label in labels),
        )
