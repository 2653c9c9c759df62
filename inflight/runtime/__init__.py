"""The serving runtime: engine, scheduler, KV block pool, model code and the HTTP server.

``from inflight.runtime import LLM, SamplingParams`` is the offline API; the step-level API
the server drives is :class:`inflight.runtime.engine.LLMEngine`.
"""

from inflight.runtime.config import EngineConfig
from inflight.runtime.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "SamplingParams"]


def __getattr__(name: str):  # lazy: importing the package must not import torch
    if name == "LLM":
        from inflight.runtime.llm import LLM

        return LLM
    if name == "LLMEngine":
        from inflight.runtime.engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
