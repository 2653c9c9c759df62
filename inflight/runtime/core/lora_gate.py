"""LoRAGate: the scheduler's adapter-slot limit at admission (issue 49).

The running set never holds requests of more than ``max_loras`` distinct adapters, so every step
(a subset of the running set) fits the device slots. A waiting request whose adapter is not
running while ``max_loras`` others are waits; it never preempts for a slot. Once one waits, the
gate *closes* for the rest of the step's admissions: later requests with an adapter wait too
(base-model requests still board), so the running adapters drain and the waiting one gets its
slot; a stream of requests for the running adapters cannot starve it. Imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from inflight.runtime.core.request import Request


class LoRAGate:
    """One step's admission check; built from the running requests."""

    def __init__(self, max_loras: int, running: Iterable[Request]) -> None:
        self.max_loras = max_loras
        self.running = {r.lora.load_id for r in running if r.lora is not None}
        self.closed = False

    def allows(self, req: Request) -> bool:
        """Whether ``req`` may board now (no state change)."""
        if req.lora is None:
            return True
        if self.closed:
            return False
        return req.lora.load_id in self.running or len(self.running) < self.max_loras

    def refuse(self, req: Request) -> None:
        """``req`` waits for a slot: close the gate to the adapters behind it."""
        self.closed = True

    def admit(self, req: Request) -> None:
        if req.lora is not None:
            self.running.add(req.lora.load_id)
