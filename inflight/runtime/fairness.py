"""Fair sharing between tenants (``scheduler_policy="fair"``): who boards next, who yields a slot.

A tenant is the request's ``user`` field (OpenAI's end-user id; requests without one share
the anonymous tenant ""). Each tenant has a service count: every token the scheduler hands
its requests (prompt chunks and decodes), so a tenant with long prompts pays for them. The
waiting request of the tenant with the least service boards first (priorities, then arrival,
order requests within a tenant); a tenant that becomes active starts at the least service of
the active tenants before the step in flight charged them (start-time fair queuing: the start
tag of the work in service), so an idle spell earns no burst credit and the newcomer goes
ahead of the tenants whose step is running now. While a tenant's request can board, the more
served tenants' prompt tokens sit that step out (:meth:`FairShare.yielding`). When
every slot is taken, a tenant below its share of slots (``max_num_sequences`` / active
tenants) may take one from the tenant furthest above its share (its newest request is
preempted and recomputed later). The waiting queue is shared the same way: a tenant holding
more than ``max_queue_len`` / active tenants waiting requests is refused (429), not everyone.
Imports no torch; knows nothing about the model.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from inflight.runtime.request import Request


class FairShare:
    """Per-tenant service counts and the choices made from them."""

    def __init__(self) -> None:
        self.served: dict[str, int] = {}  # active tenants only: memory bounded by the queue
        self.active: Counter[str] = Counter()  # unfinished requests per tenant
        self._step_charged: Counter[str] = Counter()  # charged since the last begin_step

    def begin_step(self) -> None:
        """A step is being scheduled: its charges are the work in service until the next."""
        self._step_charged.clear()

    def add(self, tenant: str) -> None:
        """A request of ``tenant`` arrived; a tenant becoming active starts at the least
        service of the active ones before the step in flight."""
        if self.active[tenant] == 0:
            self.served[tenant] = min((s - self._step_charged[t] for t, s in self.served.items()), default=0)
        self.active[tenant] += 1

    def remove(self, tenant: str) -> None:
        """A request of ``tenant`` finished (or was aborted)."""
        self.active[tenant] -= 1
        if self.active[tenant] <= 0:
            del self.active[tenant]
            self.served.pop(tenant, None)
            self._step_charged.pop(tenant, None)

    def charge(self, tenant: str, num_tokens: int) -> None:
        if tenant in self.served:
            self.served[tenant] += num_tokens
            self._step_charged[tenant] += num_tokens

    def order_key(self, req: Request) -> tuple[int, int, int]:
        """Least-served tenant first; then priority; then arrival."""
        return (self.served.get(req.tenant, 0), req.priority, req.arrival_seq)

    def yielding(self, head: Request) -> frozenset[str]:
        """Tenants served more than ``head``'s (the waiting request that boards first): their
        prompt tokens sit out a step in which ``head`` can board, so its step stays short."""
        least = self.served.get(head.tenant, 0)
        return frozenset(t for t, s in self.served.items() if s > least)

    @staticmethod
    def slot_victim(candidate: Request, running: list[Request], max_num_sequences: int,
                    waiting: Iterable[Request]) -> Request | None:  # fmt: skip
        """A running request to preempt so ``candidate`` can board when every slot is taken:
        the newest of the tenant furthest above its share, if ``candidate``'s tenant is below
        its own share; else None."""
        per_tenant = Counter(r.tenant for r in running)
        tenants = set(per_tenant) | {r.tenant for r in waiting} | {candidate.tenant}
        share = max(1, max_num_sequences // len(tenants))
        if per_tenant.get(candidate.tenant, 0) >= share:
            return None
        heaviest, count = max(per_tenant.items(), key=lambda kv: kv[1], default=(None, 0))
        if heaviest is None or heaviest == candidate.tenant or count <= share:
            return None
        return max((r for r in running if r.tenant == heaviest), key=lambda r: r.admitted_seq)

    @staticmethod
    def queue_share(tenant: str, waiting: Iterable[Request], max_queue_len: int) -> tuple[int, int]:
        """(``tenant``'s waiting requests, its share of the waiting queue)."""
        per_tenant = Counter(r.tenant for r in waiting)
        tenants = len(set(per_tenant) | {tenant})
        return per_tenant.get(tenant, 0), max(1, -(-max_queue_len // tenants))
