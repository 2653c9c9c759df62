"""The LoRA vocabulary shared by the engine, the server and the operator (issue 49).

``LoRAInfo`` is one loaded adapter as ``/v1/models`` and the operator see it; ``LoRAError`` is an
adapter refused at load (the message says why; the server answers 400); ``UnknownLoRA`` is a name no
loaded adapter has (404); ``LoRARequest`` is the offline ``LLM.generate(lora_request=...)`` argument,
with vLLM's field names. This module imports nothing heavy: no torch, no safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRAInfo:
    """One loaded adapter."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # PEFT's names: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    base_model: str | None  # adapter_config.json's base_model_name_or_path


class LoRAError(ValueError):
    """An adapter refused at load (or LoRA not enabled); the message says why."""


class UnknownLoRA(LookupError):
    """No adapter of that name is loaded."""


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """vLLM's offline ``lora_request``: the adapter's name and its PEFT directory (loaded on first use)."""

    lora_name: str
    lora_path: str


@dataclass(frozen=True, slots=True)
class LoRARef:
    """What a request carries of its adapter: the name, the engine's id of this load (a name
    unloaded and loaded again gets a new one), and the prefix-cache key (the name and the
    adapter files' SHA-256: two adapters, or an adapter and the base model, never share KV,
    and a name re-loaded with other weights never meets its old KV)."""

    name: str
    load_id: int
    cache_key: str
