"""The engine's LoRA methods (issue 49): :class:`LoRAMethods`, a base of ``LLMEngine``.

``add_lora`` / ``remove_lora`` / ``list_loras`` / ``lora_stats`` over the engine's
:class:`~inflight.runtime.lora.registry.LoRARegistry` (None when ``enable_lora`` is off), and the
two step hooks: which adapter a new request names (:meth:`LoRAMethods.lora_ref`) and the device
slots of a step's adapters (:meth:`LoRAMethods.lora_slots`). The scheduler keeps every step to
``max_loras`` adapters (:mod:`.lora_gate`); the prefix cache keys each request's KV by its
adapter (:mod:`.kv_manager`). Knows nothing about the weights' layout (:mod:`inflight.runtime.lora`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.request import Request
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.lora.registry import LoRARegistry
from inflight.runtime.lora.types import LoRAError, LoRAInfo, LoRARef, UnknownLoRA

if TYPE_CHECKING:
    from inflight.runtime.core.scheduler import Scheduler


class LoRAMethods:
    """LLMEngine's LoRA surface; ``self.lora`` is set by the engine's ``__init__``."""

    lora: LoRARegistry | None
    scheduler: Scheduler

    def _new_lora_registry(self, runner: Any, config: EngineConfig) -> LoRARegistry | None:
        if not config.enable_lora:
            return None
        if getattr(runner, "lora_slots", None) is None:
            raise ValueError("enable_lora needs a decoder model with an LM head (the generate runner).")
        return LoRARegistry(runner.spec, config.max_loras, config.max_cpu_loras, config.max_lora_rank, runner.load_lora)

    def add_lora(self, name: str, path: str) -> LoRAInfo:
        """Load the PEFT adapter at ``path`` as ``name``; ``LoRAError`` says why not (nothing changes)."""
        if self.lora is None:
            raise LoRAError("LoRA is not enabled on this engine; start it with --enable-lora.")
        return self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """New requests can no longer use ``name`` (``UnknownLoRA`` if none is loaded); requests
        already added with it finish with it, then its weights are dropped."""
        if self.lora is None:
            raise UnknownLoRA(f"no LoRA adapter named {name!r} is loaded (LoRA is not enabled).")
        self.lora.remove(name)
        self._collect_loras()

    def list_loras(self) -> list[LoRAInfo]:
        return [] if self.lora is None else self.lora.list()

    def lora_stats(self) -> tuple[list[str], list[str]]:
        """Names of the adapters of running requests and of waiting ones (vllm:lora_requests_info)."""
        def names(reqs: Iterable[Request]) -> list[str]:
            return sorted({r.lora.name for r in reqs if r.lora is not None})

        return names(self.scheduler.running), names(self.scheduler.waiting)

    def lora_ref(self, lora_name: str | None) -> LoRARef | None:
        """The adapter a new request names (``UnknownLoRA`` for a name not loaded)."""
        if lora_name is None:
            return None
        if self.lora is None:
            raise UnknownLoRA(f"no LoRA adapter named {lora_name!r} is loaded (LoRA is not enabled).")
        return self.lora.resolve(lora_name)

    def lora_slots(self, chunks: Iterable[ScheduledChunk]) -> dict[int, int] | None:
        """Device slots of the step's adapters, written now where missing; None: no LoRA row."""
        if self.lora is None:
            return None
        self._collect_loras()
        requests = self.scheduler.requests
        return self.lora.prepare_step(lora for c in chunks if (lora := requests[c.req_id].lora) is not None)

    def _collect_loras(self) -> None:
        lora = self.lora
        if lora is not None and lora.has_removed:
            sched = self.scheduler
            lora.collect(r.lora for r in (*sched.running, *sched.waiting) if r.lora is not None)

