"""The engine knobs' choices and bounds, and the checks of
:class:`~inflight.runtime.config.EngineConfig`: each knob within its bounds and the combinations
the engine refuses, each refusal naming the knobs and what to change. Called once per config,
from ``EngineConfig.__post_init__``; imports nothing of the runtime at module level (the config
re-exports the choices: the CLI and the operator's CRD read them from there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.kernels.backends import KERNEL_BACKENDS  # the --kernel-backend choices (a leaf, no torch)

SCHEDULER_POLICIES = ("fcfs", "priority", "fair", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "sim")
QUANTIZATIONS = ("auto", "none", "gguf", "compressed-tensors")  # vLLM's --quantization names
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16")  # vLLM's --kv-cache-dtype names

# Knobs the running engine can change without a restart (the admin endpoint, the operator).
LIVE_TUNABLE_FIELDS = ("max_num_sequences", "max_num_tokens", "max_queue_len")
# Seconds requests in flight may take to finish after SIGTERM. Not an engine knob, but its one
# home: the server's --drain-timeout (ServerSettings.drain_timeout_s) and the CR's
# drainTimeoutSeconds both default to it, and the operator imports this module, no server one.
DRAIN_TIMEOUT_S = 30
# The ceiling of every integer knob (sequences, tokens, blocks, queue slots): such counts index
# int32 tensors and are reported as Prometheus floats, and an admin or a flag that sets one to a
# 400-digit integer must get a refusal naming the range, not an engine nobody can scrape
# (issue 46). The seed alone may use the 64 bits torch.manual_seed takes.
MAX_CONFIG_INT = 2**31 - 1
MAX_SEED = 2**64 - 1
MAX_KV_OFFLOADING_GIB = 1 << 20  # kv_offloading_size: far past any host's memory, well inside a float
# LoRA bounds: the rank vLLM accepts at most (its choices run 8 .. 512), and slot counts far past
# what fits a device (each slot holds A and B for every targeted layer and module).
MAX_LORA_RANK = 512
MAX_LORAS = 256
MAX_CPU_LORAS = 4096

if TYPE_CHECKING:
    from inflight.runtime.config import EngineConfig


def check_engine_config(cfg: EngineConfig) -> None:
    """Raise ``ValueError`` naming the first knob of ``cfg`` out of its bounds or clashing with another."""
    _check_int(cfg, "max_num_sequences", 1)
    _check_int(cfg, "max_num_tokens", 1)
    _check_int(cfg, "block_size", 1)
    if cfg.block_size & (cfg.block_size - 1):
        raise ValueError(f"block_size must be a power of two (got {cfg.block_size}); try 16 or 32.")
    if not isinstance(cfg.kv_cache_free_gpu_mem_fraction, (int, float)) or not (
        0.0 < float(cfg.kv_cache_free_gpu_mem_fraction) <= 1.0
    ):
        raise ValueError(
            "kv_cache_free_gpu_mem_fraction must be in (0, 1] "
            f"(got {cfg.kv_cache_free_gpu_mem_fraction!r}); 0.9 is the usual choice."
        )
    if cfg.num_kv_blocks is not None:
        _check_int(cfg, "num_kv_blocks", 1)
    if cfg.max_model_len is not None:
        _check_int(cfg, "max_model_len", 1)
    if cfg.max_tokens_in_paged_kv_cache is not None:
        _check_int(cfg, "max_tokens_in_paged_kv_cache", cfg.block_size)
    if cfg.long_prefill_token_threshold is not None:
        _check_int(cfg, "long_prefill_token_threshold", 0)
    _check_int(cfg, "max_queue_len", 0)
    _check_int(cfg, "tensor_parallel_size", 1)
    _check_int(cfg, "pipeline_parallel_size", 1)
    for name, low, high in (("nnodes", 1, 4096), ("node_rank", 0, 4095), ("master_port", 1, 65535)):
        if getattr(cfg, name) is not None:
            _check_int(cfg, name, low, high)
    if cfg.master_addr is not None and (not isinstance(cfg.master_addr, str) or not cfg.master_addr):
        raise ValueError(f"master_addr must be a host name or address (got {cfg.master_addr!r}).")
    _check_int(cfg, "seed", 0, MAX_SEED)
    _check_choice(cfg, "scheduler_policy", SCHEDULER_POLICIES)
    _check_choice(cfg, "dtype", DTYPES)
    _check_choice(cfg, "device", DEVICES)
    _check_choice(cfg, "kernel_backend", KERNEL_BACKENDS)
    _check_choice(cfg, "quantization", QUANTIZATIONS)
    _check_choice(cfg, "kv_cache_dtype", KV_CACHE_DTYPES)
    if not isinstance(cfg.calculate_kv_scales, bool):
        raise ValueError(f"calculate_kv_scales must be true or false (got {cfg.calculate_kv_scales!r}).")
    if cfg.speculative_config is not None:
        if not isinstance(cfg.speculative_config, str):
            raise ValueError("speculative_config must be a JSON object given as text.")
        from inflight.runtime.spec_decode.speculative import parse_speculative_config

        spec = parse_speculative_config(cfg.speculative_config)  # raises ValueError naming the key
        if spec is not None and spec.method == "draft_model" and cfg.tensor_parallel_size > 1:
            raise ValueError(f"speculative method {spec.method} needs tensor_parallel_size 1 (a draft model or "
                             "head is not split across devices yet); use method ngram with tensor parallelism")
    _check_pooling(cfg)
    _check_lora(cfg)
    if cfg.metrics_tenants is not None:
        from inflight.runtime.core.tenant_stats import parse_metrics_tenants

        if not isinstance(cfg.metrics_tenants, str):
            raise ValueError("metrics_tenants must be tenant names separated by commas, given as text.")
        parse_metrics_tenants(cfg.metrics_tenants)  # raises ValueError naming the bad name
    if cfg.kv_events_config is not None:
        from inflight.runtime.kv_events.config import parse_kv_events_config

        if not isinstance(cfg.kv_events_config, str):
            raise ValueError("kv_events_config must be a JSON object given as text.")
        parse_kv_events_config(cfg.kv_events_config)  # raises ValueError naming the key
    for name in ("enable_chunked_context", "enable_prefix_caching", "enforce_eager"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be true or false (got {getattr(cfg, name)!r}).")
    _check_kv_offloading(cfg)
    if cfg.pipeline_parallel_size > 1:
        from inflight.runtime.distributed.pipeline_checks import check_pipeline_config

        check_pipeline_config(cfg)  # raises ValueError naming what does not combine with stages
    if cfg.async_scheduling is not None and not isinstance(cfg.async_scheduling, bool):
        raise ValueError(f"async_scheduling must be true, false or unset (auto) (got {cfg.async_scheduling!r}).")

    if cfg.device == "sim" and (cfg.tensor_parallel_size > 1 or cfg.speculative_config is not None):
        raise ValueError("device sim runs neither tensor parallelism nor speculative decoding yet; "
                         "drop tensor_parallel_size / speculative_config.")
    if cfg.sim_profile is not None and not isinstance(cfg.sim_profile, str):
        raise ValueError("sim_profile must be the path of a JSON file, given as text.")
    if cfg.sim_profile is not None and cfg.device != "sim":
        raise ValueError("sim_profile is the simulated device's; set device sim or drop sim_profile.")


def _check_lora(cfg: EngineConfig) -> None:
    if not isinstance(cfg.enable_lora, bool):
        raise ValueError(f"enable_lora must be true or false (got {cfg.enable_lora!r}).")
    _check_int(cfg, "max_loras", 1, MAX_LORAS)
    _check_int(cfg, "max_lora_rank", 1, MAX_LORA_RANK)
    if cfg.max_cpu_loras is not None:
        _check_int(cfg, "max_cpu_loras", 1, MAX_CPU_LORAS)
        if cfg.max_cpu_loras < cfg.max_loras:
            raise ValueError(f"max_cpu_loras ({cfg.max_cpu_loras}) must be >= max_loras ({cfg.max_loras}) "
                             "(vLLM's rule); raise max_cpu_loras or leave it unset.")
    if cfg.enable_lora and (cfg.runner == "pooling" or cfg.device == "sim"):
        raise ValueError("enable_lora needs the generate runner on a real device (cpu or cuda); "
                         "drop enable_lora, runner pooling or device sim.")
    if cfg.enable_lora and cfg.async_scheduling is True:
        raise ValueError("enable_lora cannot be combined with async_scheduling yet (a step's adapter "
                         "slots are loaded while it is prepared); turn one of them off.")


def _check_kv_offloading(cfg: EngineConfig) -> None:
    size = cfg.kv_offloading_size
    if size is None:
        return
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size <= MAX_KV_OFFLOADING_GIB:
        raise ValueError(f"kv_offloading_size must be a number of GiB > 0 and <= {MAX_KV_OFFLOADING_GIB} "
                         f"(got {_brief(size)}).")
    clash = ("enable_prefix_caching false (the host tier keeps prefix-cache blocks)"
             if not cfg.enable_prefix_caching
             else "tensor_parallel_size > 1" if cfg.tensor_parallel_size > 1
             else "runner pooling" if cfg.runner == "pooling" else None)  # fmt: skip
    if clash is not None:
        raise ValueError(f"kv_offloading_size cannot be combined with {clash}; drop one of them.")


def _check_pooling(cfg: EngineConfig) -> None:
    from inflight.runtime.model.pooling import RUNNERS, parse_pooler_config

    _check_choice(cfg, "runner", RUNNERS)
    if cfg.pooler_config is not None:
        if not isinstance(cfg.pooler_config, str):
            raise ValueError("pooler_config must be a JSON object given as text.")
        if cfg.runner == "generate":
            raise ValueError("pooler_config is the pooling runner's; set runner pooling (or auto) or drop it.")
        parse_pooler_config(cfg.pooler_config)  # raises ValueError naming the key
    if cfg.runner != "pooling":
        return
    clash = ("tensor_parallel_size > 1" if cfg.tensor_parallel_size > 1
             else "speculative_config" if cfg.speculative_config is not None
             else "device sim" if cfg.device == "sim"
             else "async_scheduling" if cfg.async_scheduling is True else None)  # fmt: skip
    if clash is not None:
        raise ValueError(f"the pooling runner does not run with {clash} yet; drop one of them.")


def _check_int(cfg: EngineConfig, name: str, minimum: int, maximum: int = MAX_CONFIG_INT) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ValueError(f"{name} must be an integer >= {minimum} and <= {maximum} (got {_brief(value)}).")


def _brief(value: object) -> str:
    """``repr(value)``, but a huge integer by its size (an error never echoes 400 digits back)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_choice(cfg: EngineConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)} (got {value!r}).")
