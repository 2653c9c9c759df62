"""What goes into the engine and what it says about itself: :class:`EngineRequest` (one request
to add) and :class:`EngineSummary` (what the front end may know about the loaded engine).

A leaf beside the engine: the step (``LLMEngine.add_requests``, ``summary``) and the process
protocol (:mod:`inflight.runtime.engine_core.protocol`, which carries them) both import these,
so the engine never imports the protocol (tests/test_import_graph.py). Plain frozen values.
"""

from __future__ import annotations

from dataclasses import dataclass

from inflight.runtime.config import EngineConfig
from inflight.runtime.multimodal.inputs import MultimodalInputs
from inflight.runtime.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineSummary:
    """What the front end may know about the loaded engine (published at start and after
    each retune): enough to tokenize, validate and answer without reaching into it."""

    config: EngineConfig  # live, with max_model_len and num_kv_blocks resolved
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    resolved: dict[str, str]  # what "auto" became: device, dtype, kernel_backend


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One engine request to add (a client request with ``n`` choices makes ``n``)."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None  # time.monotonic(); one clock for every process of a host
    tenant: str = ""  # the fair scheduler's unit of sharing: <group>/<user> (server.tenancy)
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks
    lora_name: str | None = None  # a loaded LoRA adapter's name (issue 49); None: the base model
    mm_inputs: MultimodalInputs | None = None  # its images, placeholders expanded in prompt_token_ids
