"""Per-tenant counts for the ``fair`` scheduler policy, with a bounded label set.

A tenant is the request's ``user`` field, which any client may set to anything: so the name
a tenant is reported under (its *label*) is sanitised (characters outside
``[A-Za-z0-9_.:@/+=-]`` become ``_``, at most :data:`MAX_TENANT_LABEL_CHARS` kept), and only
the first :data:`MAX_TRACKED_TENANTS` labels seen get a series of their own; every later one
is counted under :data:`OTHER_TENANT`. Requests without a ``user`` are the tenant
:data:`ANONYMOUS_TENANT`. A client can therefore never create more than
``MAX_TRACKED_TENANTS + 1`` series per metric, nor put arbitrary text into a label.

The engine owns one :class:`TenantMeter`, counts tokens into it as they are produced, and
publishes :meth:`TenantMeter.snapshot` in ``EngineStats.tenants`` (the stats that already
cross the process boundary each step); the front end only renders those rows. Imports no
torch; knows nothing about Prometheus or HTTP.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from inflight.runtime.outputs import TenantStats
from inflight.runtime.request import Request

# At most this many tenants get a series of their own (first come, for the life of the
# process); the rest share "other". 64 keeps a scrape small (4 metrics x 65 series) while
# covering the tenants a single replica serves in practice; raise it with care, each named
# tenant costs every scrape and every Prometheus server a series per metric.
MAX_TRACKED_TENANTS = 64
MAX_TENANT_LABEL_CHARS = 64  # longer user ids are cut (ids that share a prefix share a series)
OTHER_TENANT = "other"
ANONYMOUS_TENANT = "anonymous"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@/+=-]")


def tenant_label(tenant: str) -> str:
    """The sanitised, truncated label of a raw tenant name ("" is :data:`ANONYMOUS_TENANT`)."""
    if not tenant:
        return ANONYMOUS_TENANT
    return _UNSAFE.sub("_", tenant[:MAX_TENANT_LABEL_CHARS])


class TenantMeter:
    """Cumulative token counts per tenant label; at most ``max_tenants`` named labels."""

    def __init__(self, max_tenants: int = MAX_TRACKED_TENANTS) -> None:
        self.max_tenants = max_tenants
        # label -> [prompt tokens, generation tokens]; insertion order = first seen, "other" first
        self._counts: dict[str, list[int]] = {OTHER_TENANT: [0, 0]}
        self._labels: dict[str, str] = {}  # raw tenant -> label: a cache, bounded in entries and size

    def label(self, tenant: str) -> str:
        """``tenant``'s label, claiming a named slot while fewer than ``max_tenants`` are taken."""
        label = self._labels.get(tenant)
        if label is not None:
            return label
        label = tenant_label(tenant)
        if label not in self._counts:
            if len(self._counts) - 1 >= self.max_tenants:  # "other" is not a named slot
                label = OTHER_TENANT
            else:
                self._counts[label] = [0, 0]
        if len(self._labels) < 4 * self.max_tenants and len(tenant) <= MAX_TENANT_LABEL_CHARS:
            self._labels[tenant] = label
        return label

    def count(self, tenant: str, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Add the prompt tokens of ``tenant``'s requests (counted at a request's first output
        token, prefix-cache hits included, as the engine-wide ``num_prompt_tokens``) and the
        tokens generated for it."""
        counts = self._counts[self.label(tenant)]
        counts[0] += num_prompt_tokens
        counts[1] += num_generation_tokens

    def snapshot(self, running: Iterable[Request], waiting: Iterable[Request]) -> TenantStats:
        """Every label seen ("other" last), with each tenant's requests running and waiting now."""
        num_running: dict[str, int] = {}
        num_waiting: dict[str, int] = {}
        for queue, into in ((running, num_running), (waiting, num_waiting)):
            for req in queue:
                label = self.label(req.tenant)
                into[label] = into.get(label, 0) + 1
        labels = (*list(self._counts)[1:], OTHER_TENANT)
        return TenantStats(
            labels=labels,
            num_running=tuple(num_running.get(label, 0) for label in labels),
            num_waiting=tuple(num_waiting.get(label, 0) for label in labels),
            prompt_tokens=tuple(self._counts[label][0] for label in labels),
            generation_tokens=tuple(self._counts[label][1] for label in labels),
        )
