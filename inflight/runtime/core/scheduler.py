"""The iteration-level scheduler: which requests run in the next step, and how many tokens each.

Every step gets a token budget (``max_num_tokens``). Running requests go first (a decode
costs one token, an unfinished prompt its next chunk; a request parked while its grammar's
token mask is filled sits out, and so does one whose last token the step in flight samples
under async scheduling), then waiting requests in policy
order while the budget, ``max_num_sequences`` and free KV blocks allow. When blocks run
out, running requests are preempted by recompute: the most recently admitted first, or under
``priority`` the lowest priority (highest ``priority`` value) first. ``fair`` shares slots
and admissions between tenants by tokens served (:mod:`inflight.runtime.core.fairness`).
``static`` is the naive baseline: it admits a batch only when nothing is running.

A chunked prompt puts at most ``long_prefill_token_threshold`` tokens into one step (vLLM's
knob; off by default). Under ``fair`` the cap is per tenant group (all the prompt chunks of
its users in the step together; by default an eighth of the budget): a tenant with many long
prompts, or many users, cannot fill a step, so one arriving behind it waits for a short step
and boards with its prompt beside at most that much of the other's.

On a model whose every layer is windowed, each step first gives back the running requests'
blocks that fell wholly outside the window (:meth:`KVCacheManager.release_out_of_window`), so
they are free for this step's allocations and admissions.

With speculative decoding on, a decoding request may speculate: its chunk is its last token
plus draft tokens, each costing one token of the budget and a KV slot; which requests do, how many
drafts, and which sit a step out under async scheduling (a placeholder last token) is
:mod:`inflight.runtime.core.spec_planning`'s.

With LoRA on, a waiting request boards only while the running set keeps to ``max_loras``
distinct adapters (:mod:`inflight.runtime.core.lora_gate`): it waits otherwise, never preempts.

The chunks are plain data (:func:`~inflight.runtime.core.request.chunk_of`): the device side gets
no ``Request``; :attr:`Scheduler.requests` maps a chunk's ``req_id`` back to its live request.
Imports no torch; knows nothing about the model or sampling.
"""

from __future__ import annotations

from collections import Counter

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.fairness import FairShare, tenant_group
from inflight.runtime.core.kv_manager import KVCacheManager
from inflight.runtime.core.lora_gate import LoRAGate
from inflight.runtime.core.request import Request, RequestStatus, chunk_of, group_tables
from inflight.runtime.core.sched_output import ScheduledChunk, SchedulerOutput
from inflight.runtime.core.spec_planning import SpecPlanner
from inflight.runtime.outputs import QueueFullError


class Scheduler:
    """Holds the waiting and running queues and decides each step's batch."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}  # every unfinished request, by id (vLLM's Scheduler.requests)
        self.num_preemptions = 0
        self._admissions = 0
        self.planner = SpecPlanner(config)
        self.spec = self.planner.spec  # None: speculation off
        self.fair = FairShare() if config.scheduler_policy == "fair" else None
        self._prefill_cap: int | None = None  # the long-prefill cap of this step
        self._step_prefill: Counter[str] = Counter()  # prompt tokens scheduled this step, per tenant group
        self._yielding: frozenset[str] = frozenset()  # fair: tenants whose prompts sit this step out
        self._scheduled: list[Request] = []  # this step's chunk i's request (SchedulerOutput.requests)

    # -- queue management -------------------------------------------------------------
    def check_admission(self, num_new: int, tenant: str = "") -> None:
        """Raise ``QueueFullError`` unless ``num_new`` more requests fit.

        ``max_queue_len`` bounds the requests that cannot run now, under every policy: up to
        ``max_num_sequences`` unfinished requests run, and at most ``max_queue_len`` more wait.
        So a burst of ``max_num_sequences + max_queue_len`` into an idle engine is accepted
        whole. Under the fair policy the waiting queue is also shared between tenants
        (:meth:`FairShare.queue_refusal`): a tenant holding its share is refused, not others,
        and one tenant's flood leaves the last places to tenants with nothing waiting.
        """
        unfinished = self.num_running + self.num_waiting + num_new
        if unfinished - self.config.max_num_sequences > self.config.max_queue_len:
            raise QueueFullError(self.config.max_queue_len)
        fair = self.fair
        if fair is not None:
            free_slots = max(0, self.config.max_num_sequences - self.num_running)
            refusal = fair.queue_refusal(fair.resolve(tenant), self.waiting, num_new, free_slots,
                                         self.config.max_queue_len)
            if refusal is not None:
                raise QueueFullError(*refusal)

    def add(self, req: Request) -> None:
        if self.fair is not None:
            self.fair.add(req.tenant)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.requests[req.req_id] = req

    def remove(self, req: Request) -> None:
        """Take ``req`` out of whichever queue holds it and free its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        if self.fair is not None and req.status is not RequestStatus.FINISHED:
            self.fair.remove(req.tenant)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        if self.requests.get(req.req_id) is req:
            del self.requests[req.req_id]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _policy_key(self, req: Request) -> tuple[int, ...]:
        if self.fair is not None:
            return self.fair.order_key(req)
        if self.config.scheduler_policy == "priority":
            return (req.priority, req.arrival_seq)
        return (req.arrival_seq,)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_tokens
        self._prefill_cap = self.config.prefill_token_cap()  # the config is live-tunable
        self._step_prefill.clear()
        chunks: list[ScheduledChunk] = []
        self._scheduled = []
        preempted: list[Request] = []
        if self.kv.sliding_window is not None:
            for req in self.running:
                self.kv.release_out_of_window(req)
        yielded: list[Request] = []
        if self.fair is not None:
            self.fair.begin_step()
            yielded = self._rebalance_slots()
        self._yielding = self._fair_yielding()
        budget = self._schedule_running(budget, chunks, preempted)
        admitted: list[Request] = []
        if not preempted and self._may_admit():
            budget = self._schedule_waiting(budget, chunks, admitted)
        if self.fair is not None:  # admissions were charged as they boarded
            boarded = {r.req_id for r in admitted}
            for chunk in chunks:
                if chunk.req_id not in boarded:
                    self.fair.charge(self.requests[chunk.req_id].tenant, chunk.num_tokens)
        num_batched = self.config.max_num_tokens - budget
        return SchedulerOutput(tuple(chunks), tuple(admitted), tuple(yielded + preempted), num_batched,
                               self.kv.take_copies(),  # the host tier's copies, run before the forward
                               tuple(self._scheduled))

    def _rebalance_slots(self) -> list[Request]:
        """Fair policy, every slot taken: a waiting tenant below its share of slots takes one
        from the tenant furthest above its share (before anything is scheduled this step)."""
        yielded: list[Request] = []
        fair = self.fair
        assert fair is not None
        while self.waiting and len(self.running) >= self.config.max_num_sequences:
            gate = LoRAGate(self.config.max_loras, self.running) if self.config.enable_lora else None
            # (one whose adapter would find no slot cannot take the freed one: nobody yields to it)
            candidate = min((r for r in self.waiting if gate is None or gate.allows(r)), key=fair.order_key,
                            default=None)
            if candidate is None:
                break
            victim = fair.slot_victim(candidate, self.running, self.config.max_num_sequences, self.waiting)
            if victim is None:
                break
            self._preempt(victim)
            yielded.append(victim)
        return yielded

    def _chunk_size(self, req: Request, remaining: int, budget: int) -> int:
        """Tokens of ``req`` to run now: all ``remaining``, or a chunk when chunking applies (no
        more than the long-prefill cap leaves); 0 = wait."""
        # Recompute after preemption is always chunked: it resumes work already accepted.
        if remaining > 1 and req.tenant in self._yielding:
            return 0
        if self.config.enable_chunked_context or req.num_preemptions > 0:
            room = self._prefill_room(req) if remaining > 1 else budget
            return max(0, min(remaining, budget, room))
        return remaining if remaining <= budget else 0

    def _may_prefill(self, req: Request) -> bool:
        """Whether ``req``'s tenant may put prompt tokens into this step (fair: it does not
        yield, and it has room left under the long-prefill cap when its prompt is chunked)."""
        if req.tenant in self._yielding:
            return False
        chunked = self.config.enable_chunked_context or req.num_preemptions > 0
        return not chunked or self._prefill_room(req) > 0

    def _prefill_room(self, req: Request) -> int:
        """Prompt tokens ``req`` may still put into this step: the long-prefill cap, or under
        the fair policy what its tenant group has left of it (the budget when there is no cap)."""
        cap = self._prefill_cap
        if cap is None:
            return self.config.max_num_tokens
        return cap - self._step_prefill[tenant_group(req.tenant)] if self.fair is not None else cap

    def _schedule_running(
        self, budget: int, chunks: list[ScheduledChunk], preempted: list[Request]
    ) -> int:
        planner = self.planner
        speculate = planner.speculates(len(self.running))
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if planner.sits_out(req):
                i += 1
                continue
            remaining = len(req.token_ids) - req.num_computed_tokens
            # A decode (one token) always fits a budget > 0; a prompt chunk is sized by policy.
            num_new = 1 if remaining == 1 else self._chunk_size(req, remaining, budget)
            if num_new == 0:  # no room, or (fair) its prompt waits while a less-served tenant boards
                i += 1
                continue
            if speculate and num_new == 1:
                drafted = planner.speculative_chunk(req, budget - 1)
                if drafted is not None and self.kv.allocate_slots(req, drafted.num_tokens):
                    drafted = drafted._replace(block_table=req.block_table(),  # with the blocks just allocated
                                               group_tables=group_tables(req))
                    chunks.append(drafted)
                    self._scheduled.append(req)
                    budget -= drafted.num_tokens
                    i += 1
                    continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self._pick_victim(i)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # req itself was preempted; running[i] is now the next request
            # a decode (its last token) adds no prompt tokens to the step: its chunk without _chunk's accounting
            chunks.append(planner.decode(req) if remaining == 1 else self._chunk(req, num_new))
            self._scheduled.append(req)
            budget -= num_new
            i += 1
        return budget

    def speculates(self) -> bool:
        """Whether this step's decodes may speculate (:meth:`SpecPlanner.speculates`)."""
        return self.planner.speculates(len(self.running))

    def may_draft(self, req: Request) -> bool:
        """Whether ``req``'s next decode may carry drafts (:meth:`SpecPlanner.may_draft`)."""
        return self.planner.may_draft(req)

    def _fair_yielding(self) -> frozenset[str]:
        """Fair policy: the tenants whose prompt tokens (running chunks and admissions) sit
        this step out because a less-served tenant's request can board (a slot and a block are
        free): it boards ahead of them in a short step."""
        fair = self.fair
        if fair is None or not self.waiting or len(self.running) >= self.config.max_num_sequences:
            return frozenset()
        head = min(self.waiting, key=fair.order_key)
        if self.kv.blocks_needed(head, 1) > self.kv.pool.num_free_blocks:
            return frozenset()  # it cannot board now: yielding would only stall the others
        return fair.yielding(head)

    def _pick_victim(self, first_unscheduled: int) -> Request:
        """A request not yet scheduled this step: the newest, or the lowest priority."""
        candidates = [r for r in self.running[first_unscheduled:] if not r.in_flight]  # never a pipeline's
        if self.config.scheduler_policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.admitted_seq))
        return max(candidates, key=lambda r: r.admitted_seq)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self.num_preemptions += 1

    def _may_admit(self) -> bool:
        if self.config.scheduler_policy == "static":
            return not self.running
        return True

    def _schedule_waiting(
        self, budget: int, chunks: list[ScheduledChunk], admitted: list[Request]
    ) -> int:
        static = self.config.scheduler_policy == "static"
        self.waiting.sort(key=self._policy_key)
        gate = LoRAGate(self.config.max_loras, self.running) if self.config.enable_lora else None
        i = 0  # waiting[:i] wait for an adapter slot this step
        while i < len(self.waiting) and len(self.running) < self.config.max_num_sequences:
            if self.fair is not None:  # service changes as requests board: pick again each time
                # (among tenants with room left under the long-prefill cap)
                head = self._fair_head(i, gate)
                if head is None:
                    break
                self.waiting.remove(head)
                self.waiting.insert(i, head)
            if budget == 0 and not static:
                break
            req = self.waiting[i]
            if req.awaits_drafts:  # preempted while its step in flight speculates: how many tokens its
                i += 1  # placeholders stand for is known once that step is read (core/spec_pipeline.py)
                continue
            if gate is not None and not gate.allows(req):
                gate.refuse(req)
                i += 1
                continue
            hit_blocks = self.kv.find_prefix_hit(req)
            num_hit_tokens = len(hit_blocks) * self.kv.block_size
            remaining = req.num_tokens - num_hit_tokens
            num_new = self._chunk_size(req, remaining, budget)
            if num_new == 0 and not static:
                break
            # Static batching reserves room for the whole prompt at admission.
            reserve = remaining if static else num_new
            if not self.kv.allocate_slots(req, reserve, hit_blocks):
                break
            if req.num_preemptions == 0:
                self.kv.record_lookup(req.num_prompt_tokens, num_hit_tokens)
                req.num_cached_tokens = num_hit_tokens
            self.waiting.pop(i)
            if gate is not None:
                gate.admit(req)
            req.status = RequestStatus.RUNNING
            req.facts = req.new_facts()  # a new stay: a drafter's state of the last one is dropped
            req.admitted_seq = self._admissions
            self._admissions += 1
            self.running.append(req)
            admitted.append(req)
            if num_new > 0:
                chunks.append(self._chunk(req, num_new))
                self._scheduled.append(req)
                budget -= num_new
                if self.fair is not None:
                    self.fair.charge(req.tenant, num_new)
        return budget

    def _fair_head(self, start: int, gate: LoRAGate | None) -> Request | None:
        """Fair policy: the least-served waiting request from ``start`` that may board now; one
        whose adapter has no slot closes the gate (see LoRAGate) and the pick goes on."""
        assert self.fair is not None
        candidates = [r for r in self.waiting[start:] if self._may_prefill(r)]
        while candidates:
            head = min(candidates, key=self._policy_key)
            if gate is None or gate.allows(head):
                return head
            gate.refuse(head)
            candidates.remove(head)
        return None

    def _chunk(self, req: Request, num_new: int) -> ScheduledChunk:
        remaining = len(req.token_ids) - req.num_computed_tokens
        if remaining > 1:  # a prompt chunk (or a recompute)
            self._step_prefill[tenant_group(req.tenant)] += num_new
        return chunk_of(req, num_new, num_new == remaining, (), 0, self.planner.draft_context)

