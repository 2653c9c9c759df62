"""The mapping between the CR's ``spec.engine`` fields and the runtime's EngineConfig.

Owns: which EngineConfig fields the CR exposes (camelCase names), how a CR engine
value becomes a runtime CLI flag, and which fields are live-tunable. Everything is
derived from ``inflight.runtime.config.EngineConfig`` so there is no second copy of a
name or a default. Knows nothing about Kubernetes objects or HTTP.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from inflight.runtime.config import LIVE_TUNABLE_FIELDS, EngineConfig

# EngineConfig fields exposed as ``spec.engine.<camelCase>``. The rest are deliberately
# left out of the CR (still reachable through ``spec.engine.extraArgs``):
CR_ENGINE_FIELDS: tuple[str, ...] = (
    "max_num_sequences",
    "max_num_tokens",
    "kv_cache_free_gpu_mem_fraction",
    "block_size",
    "enable_chunked_context",
    "enable_prefix_caching",
    "max_model_len",
    "dtype",
    "scheduler_policy",
    "max_queue_len",
    "tensor_parallel_size",
    "pipeline_parallel_size",  # follows spec.nodes (one stage per pod of a LeaderWorkerSet group)
    "enforce_eager",
    "async_scheduling",
    "quantization",
    "speculative_config",  # an object in the CR (vLLM's keys), JSON text on the command line
    "max_tokens_in_paged_kv_cache",
    "enable_lora",  # also set by the operator when spec.adapters is not empty
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "kv_cache_dtype",  # fp8 KV: twice the sequences of bf16 in the same memory (docs/kv-cache-dtype.md)
    "calculate_kv_scales",
    "kv_offloading_size",  # GiB of host memory behind the prefix cache; must fit resources.memory (host_memory.py)
)
# Why each remaining field is not a CR field (a test checks the two lists cover EngineConfig).
EXCLUDED_ENGINE_FIELDS: dict[str, str] = {
    "num_kv_blocks": "CPU-only cache sizing; GPU pods size the cache by kvCacheFreeGpuMemFraction",
    "device": "pods get a GPU; 'auto' picks it",
    "sim_profile": "the simulated device's step-time file, for tests and benches; extraArgs sets it",
    "seed": "a per-request concern, not a deployment one",
    "kernel_backend": "'auto' picks Triton on CUDA; override with extraArgs for debugging",
    "long_prefill_token_threshold": "scheduler fine-tuning whose default follows schedulerPolicy; extraArgs sets it",
    "metrics_tenants": "names of tenants for per-tenant metrics, a per-deployment detail; extraArgs sets it",
    "runner": "the pooling (embeddings) runner is not yet a CR field; extraArgs (--runner) sets it",
    "pooler_config": "the pooling runner's settings, with --runner; extraArgs sets it",
    "kv_events_config": "set by the operator when inferencePool is on (the picker's precise-prefix scorer "
                        "listens); extraArgs overrides it",
    # multi-node rendezvous: the LeaderWorkerSet render passes them per pod (render_lws.group_flags)
    "nnodes": "spec.nodes sets it (render_lws.group_flags)",
    "node_rank": "each pod's LWS_WORKER_INDEX (render_lws.group_flags)",
    "master_addr": "the group leader's LWS_LEADER_ADDRESS (render_lws.group_flags)",
    "master_port": "the operator's rendezvous port (render_lws.RENDEZVOUS_PORT)",
}


def snake_to_camel(name: str) -> str:
    """``max_num_sequences`` -> ``maxNumSequences``."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def camel_to_snake(name: str) -> str:
    """``maxNumSequences`` -> ``max_num_sequences``."""
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


def snake_to_flag(name: str) -> str:
    """``max_num_sequences`` -> ``--max-num-sequences`` (the runtime CLI's spelling)."""
    return "--" + name.replace("_", "-")


def engine_fields() -> dict[str, dataclasses.Field[Any]]:
    """EngineConfig's dataclass fields by snake_case name."""
    return {f.name: f for f in dataclasses.fields(EngineConfig)}


def default_of(name: str) -> Any:
    """The EngineConfig default of a field (the only place defaults live)."""
    return engine_fields()[name].default


def live_env_name(name: str) -> str:
    """Env var that carries a live-tunable knob into the runtime container's args."""
    return "INFLIGHT_LIVE_" + name.upper()


def parse_engine(raw: dict[str, Any]) -> dict[str, Any]:
    """CR ``spec.engine`` (camelCase, without extraArgs) -> validated snake_case values.

    Unknown names and values EngineConfig rejects raise ``ValueError``.
    """
    known = {snake_to_camel(n): n for n in CR_ENGINE_FIELDS}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(
            f"spec.engine has unknown field(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(known))} (put other runtime flags in extraArgs)."
        )
    values = {known[k]: v for k, v in raw.items() if v is not None}
    if isinstance(values.get("speculative_config"), dict):
        values["speculative_config"] = json.dumps(values["speculative_config"], sort_keys=True)
    validate_engine(values)
    return values


def validate_engine(values: dict[str, Any]) -> None:
    """What the runtime's EngineConfig would refuse at start, as a spec error. Call it again on
    the values as the pod will get them (after the operator fills in ``tensor_parallel_size``
    from the GPUs): a check that only sees the fields the user wrote lets e.g. a ``draft_model``
    ``speculativeConfig`` with ``gpus: 2`` through to a crash-looping pod."""
    try:
        EngineConfig(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"spec.engine is invalid: {exc}") from exc
    check_chunked_context(values)


def check_chunked_context(values: dict[str, Any]) -> None:
    """With chunked context off the engine refuses ``max_num_tokens < max_model_len`` at start.

    The operator can tell only when ``maxModelLen`` is set (otherwise it comes from the
    model's config); then a bad spec becomes a Degraded condition, not a crash-looping pod.
    """
    max_len = values.get("max_model_len")
    chunked = values.get("enable_chunked_context", default_of("enable_chunked_context"))
    tokens = values.get("max_num_tokens", default_of("max_num_tokens"))
    if max_len is not None and not chunked and tokens < max_len:
        raise ValueError(
            f"spec.engine: maxNumTokens ({tokens}) is below maxModelLen ({max_len}) with "
            "enableChunkedContext false, so a long prompt could never be scheduled; raise "
            "maxNumTokens, lower maxModelLen, or enable chunked context."
        )


def live_values(values: dict[str, Any]) -> dict[str, Any]:
    """The live-tunable knobs, defaults filled in from EngineConfig."""
    return {name: values.get(name, default_of(name)) for name in LIVE_TUNABLE_FIELDS}


def static_flags(values: dict[str, Any]) -> list[str]:
    """CLI flags for the knobs that need a restart (set ones only; order of CR_ENGINE_FIELDS)."""
    flags: list[str] = []
    for name in CR_ENGINE_FIELDS:
        if name in LIVE_TUNABLE_FIELDS or name not in values:
            continue
        value = values[name]
        if isinstance(value, bool):
            flags.append(snake_to_flag(name) if value else "--no-" + snake_to_flag(name)[2:])
        else:
            flags += [snake_to_flag(name), str(value)]
    return flags


def live_flags() -> list[str]:
    """CLI flags for the live knobs, reading their values from env (Kubernetes ``$(VAR)``)."""
    flags: list[str] = []
    for name in LIVE_TUNABLE_FIELDS:
        flags += [snake_to_flag(name), f"$({live_env_name(name)})"]
    return flags
