"""Fair sharing between tenants (``scheduler_policy="fair"``): who boards next, who yields a slot,
who may queue.

A tenant is ``"<group>"`` or ``"<group>/<member>"`` (:func:`tenant_name`). The front end names
the group after something the client cannot mint (its API key, its peer address, or a header a
trusted gateway sets: :mod:`inflight.runtime.server.tenancy`) and the member after the request's
``user`` field, so a ``user`` only divides its own group's part: a client that sends a fresh
``user`` per request, or another client's ``user``, spends nobody's share but its own. Sharing
is two-level, each level the same way: groups share the server, a group's members share what
the group gets.

* **Service**: each group and each member has a service count, every token the scheduler hands
  its requests (prompt chunks and decodes). The waiting request of the least-served group boards
  first, within it the least-served member's (then priority, then arrival); a group (member)
  that becomes active starts at the least service of the active ones before the step in flight
  charged them (start-time fair queuing), so an idle spell earns no burst credit. While a
  request can board, the more-served tenants' prompt tokens sit that step out (:meth:`FairShare.yielding`).
* **Slots**: when every slot is taken, a group below its share (``max_num_sequences`` / active
  groups) takes one from the group furthest above its share; a member below its share of its
  group's slots takes one from its group's heaviest member (the newest request is preempted and
  recomputed later).
* **Queue** (:meth:`FairShare.queue_refusal`): the engine's global bound (``max_queue_len``
  waiting, as under fcfs) holds; within it a group may hold its share of the waiting queue and
  a member its share of its group's, and the last :func:`queue_reserve` places are kept for
  groups with nothing waiting (each may take one), so one group's flood leaves room for another
  group's first request.
* **Bounds**: at most ``max_tenants`` groups (:data:`MAX_TENANTS`) hold a share of their own at
  once; a group arriving while all are held joins :data:`OVERFLOW` (one shared group whose
  members are the groups folded into it). Active groups keep theirs: strangers arriving never
  push an established group out, and never shrink a group's share below 1 / (``max_tenants`` +
  1). The same holds for members within a group (:data:`MAX_MEMBERS`).

Imports no torch; knows nothing about the model or where the names come from.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from inflight.runtime.core.request import Request

SEPARATOR = "/"  # between a tenant's group and its member; a group name never holds one
OVERFLOW = "*"  # the group (and in each group the member) that strangers beyond the bounds share
# At most this many groups get a share of their own at once (the rest share OVERFLOW), so no
# group's share of slots, service or queue drops below 1/65 however many strangers arrive.
MAX_TENANTS = 64
MAX_MEMBERS = 64  # the same bound on the members (users) of one group


def tenant_name(group: str, member: str = "") -> str:
    """``group``, or ``group/member`` when there is a member."""
    return f"{group}{SEPARATOR}{member}" if member else group


def split_tenant(tenant: str) -> tuple[str, str]:
    """(group, member) of a tenant name (the member may hold further separators)."""
    group, _, member = tenant.partition(SEPARATOR)
    return group, member


def tenant_group(tenant: str) -> str:
    return tenant.partition(SEPARATOR)[0]


def queue_reserve(max_queue_len: int) -> int:
    """Waiting places a group with requests already waiting may not take (an eighth, at least one)."""
    return min(max_queue_len, max(1, max_queue_len // 8))


class _Level:
    """Start-time fair queuing over the active names of one level (groups, or one group's members)."""

    __slots__ = ("served", "active", "step_charged")

    def __init__(self) -> None:
        self.served: dict[str, int] = {}  # active names only: memory bounded by the queue
        self.active: Counter[str] = Counter()  # unfinished requests per name
        self.step_charged: Counter[str] = Counter()  # charged since the last begin_step

    def add(self, name: str) -> None:
        if self.active[name] == 0:
            self.served[name] = min((s - self.step_charged[t] for t, s in self.served.items()), default=0)
        self.active[name] += 1

    def remove(self, name: str) -> bool:
        """One request of ``name`` left; True when ``name`` has none left."""
        self.active[name] -= 1
        if self.active[name] > 0:
            return False
        del self.active[name]
        self.served.pop(name, None)
        self.step_charged.pop(name, None)
        return True

    def charge(self, name: str, num_tokens: int) -> None:
        if name in self.served:
            self.served[name] += num_tokens
            self.step_charged[name] += num_tokens

    def num_named(self) -> int:
        """Active names holding a share of their own (OVERFLOW is not one)."""
        return len(self.active) - (OVERFLOW in self.active)


class FairShare:
    """Per-group and per-member service counts and the choices made from them."""

    def __init__(self, max_tenants: int = MAX_TENANTS, max_members: int = MAX_MEMBERS) -> None:
        self.max_tenants = max_tenants
        self.max_members = max_members
        self._groups = _Level()
        self._members: dict[str, _Level] = {}  # per active group

    @property
    def served(self) -> dict[str, int]:
        """Service of each active group."""
        return self._groups.served

    @property
    def active(self) -> Counter[str]:
        """Unfinished requests of each active group."""
        return self._groups.active

    def resolve(self, tenant: str) -> str:
        """The tenant a new request of ``tenant`` counts as: itself (normalised), or folded into
        :data:`OVERFLOW` when its group (member) is not active and the bound is reached."""
        group, member = split_tenant(tenant)
        if group != OVERFLOW and group not in self._groups.active and self._groups.num_named() >= self.max_tenants:
            group, member = OVERFLOW, group
        members = self._members.get(group)
        if (members is not None and member != OVERFLOW and member not in members.active
                and members.num_named() >= self.max_members):  # fmt: skip
            member = OVERFLOW
        return tenant_name(group, member)

    def begin_step(self) -> None:
        """A step is being scheduled: its charges are the work in service until the next."""
        self._groups.step_charged.clear()
        for members in self._members.values():
            members.step_charged.clear()

    def add(self, tenant: str) -> None:
        """A request of ``tenant`` (as :meth:`resolve` named it) arrived."""
        group, member = split_tenant(tenant)
        self._groups.add(group)
        self._members.setdefault(group, _Level()).add(member)

    def remove(self, tenant: str) -> None:
        """A request of ``tenant`` finished (or was aborted)."""
        group, member = split_tenant(tenant)
        members = self._members.get(group)
        if members is not None:
            members.remove(member)
        if self._groups.remove(group):
            self._members.pop(group, None)

    def charge(self, tenant: str, num_tokens: int) -> None:
        group, member = split_tenant(tenant)
        self._groups.charge(group, num_tokens)
        members = self._members.get(group)
        if members is not None:
            members.charge(member, num_tokens)

    def order_key(self, req: Request) -> tuple[int, int, int, int]:
        """Least-served group first, then its least-served member; then priority; then arrival."""
        group, member = split_tenant(req.tenant)
        members = self._members.get(group)
        member_served = members.served.get(member, 0) if members is not None else 0
        return (self._groups.served.get(group, 0), member_served, req.priority, req.arrival_seq)

    def yielding(self, head: Request) -> frozenset[str]:
        """Tenants served more than ``head``'s (the waiting request that boards first): every
        tenant of a more-served group, and the more-served members of its own group. Their
        prompt tokens sit out a step in which ``head`` can board, so its step stays short."""
        group, member = split_tenant(head.tenant)
        least = self._groups.served.get(group, 0)
        out: set[str] = set()
        for g, served in self._groups.served.items():
            members = self._members.get(g)
            if members is None:
                continue
            if served > least:
                out.update(tenant_name(g, m) for m in members.served)
            elif g == group:
                own = members.served.get(member, 0)
                out.update(tenant_name(g, m) for m, s in members.served.items() if s > own)
        return frozenset(out)

    @staticmethod
    def slot_victim(candidate: Request, running: list[Request], max_num_sequences: int,
                    waiting: Iterable[Request]) -> Request | None:  # fmt: skip
        """A running request to preempt so ``candidate`` can board when every slot is taken:
        the newest of the heaviest member of the group furthest above its share, if
        ``candidate``'s group is below its own share; else, within ``candidate``'s group, the
        newest of the member furthest above its share of the group's slots, if ``candidate``'s
        member is below its own; else None."""
        waiting = list(waiting)
        group, member = split_tenant(candidate.tenant)
        per_group = Counter(tenant_group(r.tenant) for r in running)
        groups = set(per_group) | {tenant_group(r.tenant) for r in waiting} | {group}
        heavy = _over_share(group, per_group, len(groups), max_num_sequences)
        if heavy is not None:
            pool = [r for r in running if tenant_group(r.tenant) == heavy]
            top = Counter(r.tenant for r in pool).most_common(1)[0][0]
            return max((r for r in pool if r.tenant == top), key=lambda r: r.admitted_seq)
        mine = [r for r in running if tenant_group(r.tenant) == group]
        per_member = Counter(split_tenant(r.tenant)[1] for r in mine)
        members = set(per_member) | {member} | {
            split_tenant(r.tenant)[1] for r in waiting if tenant_group(r.tenant) == group}
        heavy = _over_share(member, per_member, len(members), len(mine))
        if heavy is None:
            return None
        return max((r for r in mine if split_tenant(r.tenant)[1] == heavy), key=lambda r: r.admitted_seq)

    def queue_refusal(self, tenant: str, waiting: Sequence[Request], num_new: int, free_slots: int,
                      max_queue_len: int) -> tuple[int, str] | None:  # fmt: skip
        """None when ``num_new`` more requests of ``tenant`` may wait (the engine has checked the
        global bound); else (the limit they would pass, what it is of). Requests that take a
        free slot at the next step (``free_slots``) do not count as waiting."""
        group, member = split_tenant(tenant)
        per_group = Counter(tenant_group(r.tenant) for r in waiting)
        kept = 0 if per_group[group] else 1  # a group with nothing waiting may take one kept place
        if num_new > kept and len(waiting) + num_new - kept - free_slots > max_queue_len - queue_reserve(max_queue_len):
            return max_queue_len, "the server's waiting queue (its last places are kept for other tenants)"
        group_share = max(1, -(-max_queue_len // len(set(per_group) | {group})))
        if per_group[group] + num_new - free_slots > group_share:
            return group_share, "this tenant's share of the waiting queue"
        per_member = Counter(split_tenant(r.tenant)[1] for r in waiting if tenant_group(r.tenant) == group)
        member_share = max(1, -(-group_share // len(set(per_member) | {member})))
        if per_member[member] + num_new - free_slots > member_share:
            return member_share, "this user's share of its tenant's part of the waiting queue"
        return None


def _over_share(name: str, holders: Counter[str], num_names: int, slots: int) -> str | None:
    """The holder furthest above its share of ``slots`` (split between ``num_names``), when
    ``name`` holds less than its share and that holder is another; else None."""
    share = max(1, slots // num_names)
    if holders.get(name, 0) >= share:
        return None
    heaviest, count = max(holders.items(), key=lambda kv: kv[1], default=(None, 0))
    if heaviest is None or heaviest == name or count <= share:
        return None
    return heaviest
