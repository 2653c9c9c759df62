"""The serving runtime: engine, scheduler, KV block pool, model code and the HTTP server.

``from inflight.runtime import LLM, SamplingParams`` is the offline API; the step-level API
the server drives is :class:`inflight.runtime.core.engine.LLMEngine`.
"""

import os as _os
import sys as _sys

# The engine's OpenMP threads share the cores with the server's event loop: they must wait
# passively (sleep, not spin) or every op stalls on a descheduled thread. libgomp reads this
# once, when torch loads it, so it is set here, before anything of ours imports torch; a
# process that imported torch first keeps its policy (and the engine then keeps one core
# free: see inflight.runtime.worker.cpu.device_setup.cpu_thread_counts).
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from inflight.runtime.config import EngineConfig  # noqa: E402
from inflight.runtime.lora.types import LoRARequest  # noqa: E402  (no torch: the offline LoRA argument)
from inflight.runtime.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "EngineConfig", "LLMEngine", "LoRARequest", "SamplingParams"]


def __getattr__(name: str):  # lazy: importing the package must not import torch
    if name == "LLM":
        from inflight.runtime.llm import LLM

        return LLM
    if name == "LLMEngine":
        from inflight.runtime.core.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
