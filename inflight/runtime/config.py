"""EngineConfig: the one place where every engine knob and its default live (its choices, bounds
and checks: :mod:`.config_checks`).

The CLI flags (``inflight serve --max-num-sequences ...``), the operator's CR ``engine``
fields (camelCase of the same names) and the tests all map onto these fields by name.
Knob names follow TensorRT-LLM's vocabulary. This module knows nothing about torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from inflight.kernels.backends import KERNEL_BACKENDS  # the --kernel-backend choices (a leaf, no torch)
from inflight.runtime.config_checks import (  # re-exported: the knobs' choices and bounds live there
    DEVICES,
    DRAIN_TIMEOUT_S,
    DTYPES,
    KV_CACHE_DTYPES,
    LIVE_TUNABLE_FIELDS,
    MAX_CONFIG_INT,
    MAX_SEED,
    QUANTIZATIONS,
    SCHEDULER_POLICIES,
    check_engine_config,
)

__all__ = ["DEVICES", "DRAIN_TIMEOUT_S", "DTYPES", "KERNEL_BACKENDS", "KV_CACHE_DTYPES", "LIVE_TUNABLE_FIELDS",
           "MAX_CONFIG_INT", "MAX_SEED", "QUANTIZATIONS", "SCHEDULER_POLICIES", "EngineConfig"]


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine knobs. Construct with keywords; invalid values raise ``ValueError``."""

    max_num_sequences: int = field(
        default=64, metadata=_help("Most requests decoded together in one step (the batch size).")
    )
    max_num_tokens: int = field(
        default=2048,
        metadata=_help("Token budget of one step: decodes cost 1, prompt chunks their length."),
    )
    block_size: int = field(default=16, metadata=_help("Tokens per KV-cache block."))
    kv_cache_free_gpu_mem_fraction: float = field(
        default=0.9,
        metadata=_help("CUDA: fraction of the GPU memory free after the weights load given to the KV cache."),
    )
    num_kv_blocks: int | None = field(
        default=None,
        metadata=_help(
            "Explicit number of KV blocks (overrides the memory fraction; the way to size the "
            "cache on the CPU). Default on the CPU: enough for max_num_sequences full-length "
            "sequences, capped at 4 GiB."
        ),
    )
    max_tokens_in_paged_kv_cache: int | None = field(
        default=None,
        metadata=_help(
            "TensorRT-LLM's cap on the KV cache, in tokens: the cache gets the smaller of this and "
            "what kv_cache_free_gpu_mem_fraction (or num_kv_blocks) gives."
        ),
    )
    enable_chunked_context: bool = field(
        default=True, metadata=_help("Split long prompts across steps so decodes keep flowing.")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_help("Share KV blocks between requests with identical prompt prefixes.")
    )
    kv_offloading_size: float | None = field(
        default=None,
        metadata=_help(
            "GiB of host memory behind the prefix cache (vLLM's native CPU offloading): full cached blocks "
            "the device pool evicts are copied there, and a prefix hit there is copied back instead of "
            "recomputed (docs/kv-offloading.md). Needs prefix caching; not with tensor parallelism or "
            "the pooling runner. Off when unset."
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_help("Longest prompt + output in tokens. Default: the model's max_position_embeddings."),
    )
    scheduler_policy: str = field(
        default="fcfs",
        metadata=_help(
            "fcfs | priority | fair (tenants, by API key or --tenant-header, and the users within "
            "each, share slots and queue by tokens served) | static (naive baseline: admit a "
            "batch, wait for all of it)."
        ),
    )
    long_prefill_token_threshold: int | None = field(
        default=None,
        metadata=_help(
            "Most prompt tokens one request puts into one step (vLLM's name; 0: no cap but "
            "max_num_tokens). Under the fair policy it caps one tenant's prompt tokens per step, "
            "all its requests together, so a tenant arriving behind another's long prompts waits "
            "for a short step. Default: max_num_tokens / 8 under fair, no cap otherwise. Applies "
            "to chunked prompts only."
        ),
    )
    max_queue_len: int = field(
        default=1024, metadata=_help("Most requests waiting for admission; more are rejected (HTTP 429).")
    )
    dtype: str = field(
        default="auto",
        metadata=_help("auto | float32 | bfloat16 | float16. auto: the checkpoint's dtype on CUDA, float32 on the CPU."),
    )
    device: str = field(
        default="auto",
        metadata=_help("auto | cpu | cuda | sim. sim: a simulated device (no weights loaded; a modelled step "
                       "time, deterministic tokens; docs/simulated-device.md)."),
    )
    seed: int = field(default=0, metadata=_help("Seed for requests that bring no seed of their own."))
    tensor_parallel_size: int = field(
        default=1,
        metadata=_help("Split the model across this many devices (ranks) of one node; 1: no split."),
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata=_help("Split the decoder layers into this many stages, each on its own ranks (tensor_parallel_size "
                       "of them; world size TP x PP); 1: no pipeline. docs/multi-node.md."),
    )
    nnodes: int | None = field(
        default=None,
        metadata=_help("Nodes the TP x PP ranks span (the same number of ranks on each); unset: LWS_GROUP_SIZE, "
                       "else 1. Nodes other than 0 run `inflight serve ... --headless`."),
    )
    node_rank: int | None = field(
        default=None,
        metadata=_help("This node's index (0: the engine, rank 0, and the HTTP server); unset: LWS_WORKER_INDEX, "
                       "else 0."),
    )
    master_addr: str | None = field(
        default=None,
        metadata=_help("Address of node 0, where the ranks meet; unset: LWS_LEADER_ADDRESS, else 127.0.0.1."),
    )
    master_port: int | None = field(
        default=None,
        metadata=_help("Port node 0 opens for the ranks to meet; unset: 29500 with several nodes, any free port "
                       "with one."),
    )
    kernel_backend: str = field(
        default="auto",
        metadata=_help(
            "auto | triton | torch | cpu: which attention/KV kernels run (auto: Triton on CUDA, "
            "the native C kernels on the CPU when a C compiler can build them, else torch)."
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=_help(
            "auto | fp8 | fp8_e4m3 | fp8_e5m2 | bfloat16 (vLLM's names): how the paged KV cache stores K "
            "and V. auto: the serving dtype; fp8 (= fp8_e4m3) and fp8_e5m2: one byte per value with a "
            "per-layer K and V scale (from the checkpoint, else --calculate-kv-scales, else 1.0), "
            "so the same memory holds 2x the blocks of bf16; bfloat16: a float32 engine's cache on the "
            "CPU at half its bytes (a bfloat16 engine's is bfloat16 already). Not token-exact "
            "(docs/kv-cache-dtype.md)."
        ),
    )
    calculate_kv_scales: bool = field(
        default=False,
        metadata=_help(
            "With an fp8 KV cache and no scales in the checkpoint: set each layer's K and V scale "
            "from the first prompt's K/V (amax / 200 for K, / 100 for V: vLLM's); else 1.0."
        ),
    )
    quantization: str = field(
        default="auto",
        metadata=_help(
            "auto | none | gguf | compressed-tensors: how the weights are held. auto: as the "
            "checkpoint stores them (a GGUF file's Q4_0/Q4_1/Q8_0/K-quant tensors stay packed "
            "where the model allows it; a compressed-tensors pack-quantized directory stays "
            "int4/int8), else the float --dtype. none: every weight dequantized to --dtype."
        ),
    )
    speculative_config: str | None = field(
        default=None,
        metadata=_help(
            'Speculative decoding as vLLM configures it, a JSON object: {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, '
            '"disable_by_batch_size": 8}, or a small draft model that shares the tokenizer: '
            '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}, or an EAGLE-3 head trained '
            'for the served model: {"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}, or the served '
            'DeepSeek-V3 / GLM-4.5 checkpoint\'s own MTP layer: {"method": "mtp", "num_speculative_tokens": 1}. '
            'Off when unset.'
        ),
    )
    runner: str = field(
        default="auto",
        metadata=_help(
            "auto | generate | pooling (vLLM's names): pooling serves /v1/embeddings, /v1/score and "
            "/v1/rerank instead of text generation (docs/embeddings.md). auto: pooling for a checkpoint "
            "with no LM head (an embedding model saved as *Model, a *ForSequenceClassification reranker), "
            "else generate."
        ),
    )
    pooler_config: str | None = field(
        default=None,
        metadata=_help(
            'The pooling runner\'s pooling as vLLM configures it, a JSON object: {"pooling_type": "LAST" | '
            '"MEAN" | "CLS", "normalize": true, "is_matryoshka": true, "matryoshka_dimensions": [...]}. '
            "Unset: what the model directory says (sentence-transformers' modules.json), else LAST + normalize."
        ),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=_help(
            "Run every step eagerly: no CUDA graphs for pure-decode steps (CUDA only; the CPU "
            "is always eager)."
        ),
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata=_help(
            "Prepare step N+1 on the host while step N runs (forward passes and sampling on a "
            "worker thread): finished requests leave one step later, tokens are unchanged "
            "(docs/gpu.md); a speculating step drains the pipeline. Unset (auto): on "
            "with device sim, off elsewhere (CUDA stays off until a GPU run shows it wins)."
        ),
    )
    sim_profile: str | None = field(
        default=None,
        metadata=_help(
            "device sim: a JSON file of the step-time profile (base_ms, decode_row_ms, prefill_token_ms, "
            "attention_ms_per_1k_context); unset: H100 figures (docs/simulated-device.md)."
        ),
    )
    metrics_tenants: str | None = field(
        default=None,
        metadata=_help(
            "Under the fair policy, the tenants (comma-separated: an API key's key:<digest>, "
            "addr:<peer>, or a --tenant-header value) whose per-tenant metrics carry their name; "
            "every other tenant is counted as 'other'. Unset: tenants are labelled by a keyed "
            "digest, at most 64 at a time."
        ),
    )
    kv_events_config: str | None = field(
        default=None,
        metadata=_help(
            'KV-cache events as vLLM configures them, a JSON object: {"enable_kv_cache_events": true, '
            '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": null, "buffer_steps": 10000, '
            '"hwm": 100000, "max_queue_size": 100000, "topic": ""}: which prefix-cache blocks are stored '
            "and evicted, sent over ZMQ as vLLM's msgpack BlockStored / BlockRemoved / AllBlocksCleared "
            "for a router such as llm-d's precise-prefix scorer (docs/kv-events.md). Off when unset."
        ),
    )

    enable_lora: bool = field(
        default=False,
        metadata=_help(
            "Serve PEFT LoRA adapters on the base model (vLLM's flag): rows of one step may use "
            "different adapters (docs/lora.md)."
        ),
    )
    max_loras: int = field(
        default=1, metadata=_help("Most distinct LoRA adapters in one step (device slots).")
    )
    max_lora_rank: int = field(
        default=16,
        metadata=_help("Largest LoRA rank accepted; device slots are padded to it (vLLM's choices: "
                       "8, 16, 32, 64, 128, 256, 320, 512; any positive integer up to 512 works)."),
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata=_help("Most LoRA adapters kept as host copies (LRU); unset: max_loras. Must be >= max_loras."),
    )

    def __post_init__(self) -> None:
        check_engine_config(self)  # raises ValueError naming the knob

    @property
    def async_scheduling_on(self) -> bool:
        """Whether steps are pipelined: ``async_scheduling`` as set, or auto (unset): on with
        device sim (a modelled GPU that runs while the host prepares), off elsewhere and off
        with speculative decoding or tensor parallelism."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device == "sim" and self.speculative_config is None and self.tensor_parallel_size == 1

    def replace(self, **changes: Any) -> EngineConfig:
        """A validated copy with ``changes`` applied; unknown names raise ``ValueError``."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown engine config field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    def prefill_token_cap(self) -> int | None:
        """The ``long_prefill_token_threshold`` in force (its default resolved); None: no cap."""
        if self.long_prefill_token_threshold is None:
            return max(1, self.max_num_tokens // 8) if self.scheduler_policy == "fair" else None
        return self.long_prefill_token_threshold or None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

