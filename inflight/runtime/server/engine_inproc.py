"""The engine core on a thread of this process (``--single-process``, and most server tests).

:class:`InprocEngine` is a :class:`~.core_client.CoreClient` whose core
(:class:`~inflight.runtime.engine_core.inproc.InprocCore`) runs the same
:class:`~inflight.runtime.engine_core.core.EngineCore` loop as the engine-core process, on a
thread, over an in-memory channel: the same messages, the same failure policy, fault hook,
heartbeat and step clock, the same text path in the front end. Only where the loop runs differs
(vLLM's ``InprocClient``). What it adds is what sharing a process allows: the front end reads the
loaded engine itself (its tokenizer, config and grammar compiler: thread-safe readers), and
tests may hold the loop between two steps (:meth:`InprocEngine.between_steps`). A dead loop
cannot be killed, only cut off: the channel closes, and a thread stalled in a step stays parked
(``serve`` then ends the process). Knows nothing about HTTP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from inflight.runtime.engine_core import protocol as p
from inflight.runtime.engine_core.inproc import InprocCore
from inflight.runtime.outputs import EngineStats
from inflight.runtime.server.core_client import CoreClient
from inflight.runtime.server.engine_client import DEFAULT_MAX_BACKLOG
from inflight.runtime.server.lora import LoRAModule

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine


class InprocEngine(CoreClient):
    """The front end's handle on an engine core running on a thread. Create on the event loop.

    ``loader`` builds the engine on that thread (``() -> LLMEngine``, not warmed up; it sends
    token ids only: the front end makes the text, as for a process)."""

    core_name = "the engine thread"

    def __init__(
        self,
        loader: Callable[[], LLMEngine],
        on_step: Callable[[EngineStats], None] | None = None,
        on_death: Callable[[str], None] | None = None,
        max_backlog: int = DEFAULT_MAX_BACKLOG,
        lora_modules: Sequence[LoRAModule] = (),
    ) -> None:
        self._core = InprocCore(loader)
        super().__init__(self._core.conn, self._core.step_clock, on_step, on_death, max_backlog, lora_modules)

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[LLMEngine]:
        """Tests only: hold the loop between two steps (it finishes the turn it is in, then waits)
        and yield the engine. Blocks: never call it on the event loop."""
        core = self._core.core
        if core is None:
            raise RuntimeError("the engine is not loaded yet")
        with core.turn:
            yield core.engine

    def _start_core(self) -> None:
        self._core.start()

    def _join(self, timeout: float) -> None:
        self._core.thread.join(timeout)

    def kill(self) -> None:
        """Cut the loop off: its channel closes (a thread cannot be killed)."""
        self._core.close()

    def _core_ended(self) -> str:
        return "its channel closed"

    async def _make_view(self, summary: p.EngineSummary) -> LLMEngine:
        core = self._core.core
        if core is None:
            raise RuntimeError("the engine thread sent Ready without an engine")
        return core.engine
