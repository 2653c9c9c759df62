"""The second half of the ``vllm serve`` ledger: vLLM's multi-modal, LoRA, observability, scheduler,
compilation and engine groups (``MULTIMODAL`` ... ``ENGINE``), in vLLM 0.32.0's order, and the flags of
earlier releases that scripts still carry (``LEGACY``). Data only: :mod:`.vllm_flag_rows` holds the
first half and assembles ``SECTIONS``; the kinds of answer are :mod:`.vllm_flag_kinds`.
"""

from __future__ import annotations

from inflight.runtime.cli.vllm_flag_kinds import VllmFlag, alias, notice, only, refused, refused_on, switch
from inflight.runtime.cli.vllm_flag_reasons import (
    DISAGG,
    DP,
    GRAPHS,
    KERNELS,
    LORA_KERNEL,
    LORA_MOE,
    METRICS,
    MM,
    MOE,
    PLUGINS,
    REASONING,
    SCHEDULER,
)

MULTIMODAL: tuple[VllmFlag, ...] = (
    alias("--limit-mm-per-prompt", "--limit-mm-per-prompt", 'Images only: {"image": N} (default 4).'),
    refused_on("--enable-mm-embeds", MM),
    notice("--media-io-kwargs", MM),
    notice("--mm-processor-kwargs", MM),
    notice("--mm-processor-cache-gb", MM),
    notice("--mm-processor-cache-type", MM),
    notice("--mm-hasher-algorithm", MM),
    notice("--mm-shm-cache-max-object-size-mb", MM),
    refused_on("--mm-encoder-only", MM),
    notice("--mm-encoder-tp-mode", MM),
    notice("--mm-encoder-attn-backend", MM),
    notice("--mm-encoder-attn-dtype", MM),
    notice("--mm-encoder-fp8-scale-path", MM),
    notice("--mm-encoder-fp8-scale-save-path", MM),
    notice("--mm-encoder-fp8-scale-save-margin", MM),
    switch("--interleave-mm-strings", MM),
    switch("--skip-mm-profiling", MM),
    notice("--video-pruning-rate", MM),
    notice("--video-pruning-method", MM),
    notice("--mm-tensor-ipc", MM),
    notice("--mm-processor-device", MM),
    notice("--mm-ipc-gpu-memory-gb", MM),
    switch("--mm-device-do-normalize", MM),
)

LORA_FLAGS: tuple[VllmFlag, ...] = (
    alias("--enable-lora", "--enable-lora", "PEFT adapters in the batch (docs/lora.md).", 0, negatable=True),
    alias("--max-loras", "--max-loras", "Most distinct adapters in one step."),
    alias("--max-lora-rank", "--max-lora-rank", "Any rank 1..512 (vLLM's choices included)."),
    notice("--lora-dtype", "adapters are kept in the model's serving dtype (--dtype)"),
    switch("--enable-tower-connector-lora", MM),
    alias("--max-cpu-loras", "--max-cpu-loras", "Host copies kept (LRU); unset: --max-loras."),
    switch("--fully-sharded-loras", f"not built: {LORA_KERNEL}; with tensor parallelism each rank holds the "
           "slices of A and B that match its slice of the base weight"),
    notice("--lora-target-modules", "each adapter's own target_modules (adapter_config.json) are applied; "
           "narrowing them for all adapters is not built", "+"),
    refused("--default-mm-loras", MM),
    switch("--specialize-active-lora", f"not built: {LORA_KERNEL}"),
    switch("--enable-mixed-moe-lora-format", LORA_MOE),
    switch("--enable-moe-shared-loras", LORA_MOE),
    notice("--max-lora-cls-labels", "no LoRA classification heads: the pooling runner refuses --enable-lora"),
)

OBSERVABILITY: tuple[VllmFlag, ...] = (
    refused("--logging-config", "logging is configured by --log-level and --log-format"),
    alias("--log-level", "--log-level", "debug, info, warning, error or critical (trace is debug)."),
    refused("--log-config-file", "logging is configured by --log-level and --log-format"),
    notice("--show-hidden-metrics-for-version", METRICS),
    refused("--otlp-traces-endpoint", "no OpenTelemetry tracing"),
    refused("--collect-detailed-traces", "no OpenTelemetry tracing", "+"),
    only("--per-request-spec-decode-metrics", ("none",), "responses carry no speculative-decoding metrics",
         "not implemented: responses carry no per-request speculative-decoding metrics (/metrics has the totals)"),
    switch("--kv-cache-metrics", "/metrics has inflight's own KV cache metrics (docs/metrics.md)"),
    notice("--kv-cache-metrics-sample", "/metrics has inflight's own KV cache metrics (docs/metrics.md)"),
    notice("--custom-histogram-buckets", f"histograms keep inflight's own buckets; {METRICS}"),
    switch("--cudagraph-metrics", "decode-graph captures are reported in the load log"),
    switch("--enable-layerwise-nvtx-tracing", "no NVTX ranges"),
    switch("--enable-mfu-metrics", "no MFU metrics"),
    switch("--enable-logging-iteration-details", "the stats line is the engine's periodic log"),
    notice("--jit-monitor-mode", "no JIT-compilation monitor"),
    switch("--jit-monitor-verbose", "no JIT-compilation monitor"),
)

SCHEDULER_FLAGS: tuple[VllmFlag, ...] = (
    alias("--max-num-batched-tokens", "--max-num-tokens", "The token budget of one step. Live-tunable."),
    alias("--max-num-scheduled-tokens", "--max-num-tokens", "inflight has one budget per step and draft tokens "
          "count in it, so vLLM's cap on scheduled tokens and its batch budget are the same flag here: given "
          "with --max-num-batched-tokens, the one given last wins."),
    alias("--max-num-seqs", "--max-num-sequences", "Live-tunable."),
    alias("--max-num-active-seqs", "--max-num-sequences", "The most requests running at once; inflight sizes "
          "its decode graphs from the same number. Given with --max-num-seqs, the one given last wins."),
    refused("--max-num-queued-reqs", "inflight bounds waiting requests only (running ones are capped by "
            "--max-num-sequences): use --max-queue-len N, beyond which requests get 429"),
    refused("--max-num-queued-tokens", "no admission bound on queued prompt tokens: --max-queue-len bounds the "
            "waiting requests (429 beyond)"),
    alias("--long-prefill-token-threshold", "--long-prefill-token-threshold",
          "Caps a chunked prompt's tokens per step; 0 turns the cap off. Under --scheduler-policy fair it caps "
          "one tenant's prompt tokens per step and defaults to --max-num-tokens / 8."),
    switch("--long-prefill-token-threshold-adaptive",
           "no adaptive floor: --long-prefill-token-threshold is a fixed cap here"),
    alias("--scheduling-policy", "--scheduler-policy", "inflight also has fair and static; a request's "
          "priority is refused (400) under fcfs and static."),
    alias("--enable-chunked-prefill", "--enable-chunked-context", "On by default.", 0, negatable=True),
    switch("--disable-chunked-mm-input", MM),
    refused("--scheduler-cls", PLUGINS),
    switch("--scheduler-reserve-full-isl", SCHEDULER),
    notice("--watermark", "no free-block watermark: waiting requests are admitted while free KV blocks allow "
           "(when they run out, one is preempted and recomputed)"),
    only("--prefill-schedule-interval", ("1",), "prompt chunks are scheduled every step",
         "no prefill cadence: prompt chunks are scheduled every step (--long-prefill-token-threshold caps them)"),
    switch("--disable-hybrid-kv-cache-manager", "one kind of KV cache here"),
    alias("--async-scheduling", "--async-scheduling", "Prepare step N+1 while step N runs (docs/gpu.md).", 0,
          negatable=True),
    alias("--stream-interval", "--stream-interval", "A stream that falls behind also sends what piled up "
          "in one chunk."),
)

COMPILATION: tuple[VllmFlag, ...] = (
    notice("--cudagraph-capture-sizes", GRAPHS, "+"),
    notice("--max-cudagraph-capture-size", GRAPHS),
    notice("--ir-op-priority", KERNELS),
    switch("--enable-flashinfer-autotune", KERNELS),
    notice("--moe-backend", MOE),
    notice("--linear-backend", KERNELS),
    notice("--sparse-indexer-topk-backend", KERNELS),
)

ENGINE: tuple[VllmFlag, ...] = (
    alias(("--speculative-config", "-sc"), "--speculative-config",
          "n-gram (prompt lookup), a draft model that shares the tokenizer (method draft_model), an "
          "EAGLE-3 head (method eagle3; eagle, EAGLE-1/2, is refused), or the served DeepSeek-V3 / GLM-4.5 "
          "checkpoint's own MTP layer (method mtp; deepseek_mtp and glm4_moe_mtp read as mtp)."),
    refused("--spec-method", "use --speculative-config '{\"method\": \"ngram\" or \"draft_model\", ...}'"),
    refused("--spec-model", "use --speculative-config '{\"method\": \"draft_model\", \"model\": DIR}'"),
    refused("--spec-tokens", "use --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": N}'"),
    refused("--watermark-config", "no output watermarking"),
    refused(("--diffusion-config", "-dc"), "no diffusion language models here"),
    refused("--kv-transfer-config", DISAGG),
    alias("--kv-events-config", "--kv-events-config",
          "ZMQ publisher with vLLM's msgpack events, sequence numbers and replay socket (docs/kv-events.md)."),
    refused("--ec-transfer-config", DISAGG),
    notice("--ec-manager-config", MM),
    notice(("--compilation-config", "-cc"), GRAPHS),
    notice(("--attention-config", "-ac"), KERNELS),
    notice("--engram-config", "no Engram (conditional memory) models here"),
    notice("--reasoning-config", REASONING),
    notice("--kernel-config", KERNELS),
    notice("--additional-config", PLUGINS),
    notice("--structured-outputs-config", "structured output runs on inflight's own llguidance integration"),
    refused("--aux-output-config", "not implemented: outputs carry no auxiliary data (routed experts, "
            "hidden states)"),
    refused("--profiler-config", "no profiler endpoints"),
    notice("--optimization-level", GRAPHS),
    notice("--performance-mode", "tune with --max-num-sequences and --max-num-tokens (docs/tuning.md)"),
    refused("--weight-transfer-config", "no weight-transfer endpoints"),
    alias("--disable-log-stats", "--no-stats-log", "", 0),
    switch("--aggregate-engine-logging", DP, negatable=False),
    switch("--fail-on-environ-validation", "no environment validation step"),
    alias("--shutdown-timeout", "--drain-timeout", "vLLM's default is 0 (abort at once); inflight's is 30 s."),
    notice("--gdn-prefill-backend", "no gated-delta-net models here"),
    notice("--kda-prefill-backend", "no Kimi delta attention (KDA) models here"),
    notice("--kda-decode-backend", "no Kimi delta attention (KDA) models here"),
    switch("--enable-log-requests", "inflight logs one line per finished request (no prompt or output) and "
           "one access line per HTTP request (--no-access-log turns those off)"),
)

LEGACY: tuple[VllmFlag, ...] = (
    alias("--disable-log-requests", "--no-access-log", "Turns off the access log.", 0, negatable=True),
    notice("--swap-space", "no CPU swap space: a preempted request is recomputed, as in vLLM V1"),
    alias("--disable-frontend-multiprocessing", "--single-process", "", 0),
    notice("--max-seq-len-to-capture", GRAPHS),
    alias("--task", "--runner", "embed, embedding, classify and score mean --runner pooling; auto and generate "
          "as named; reward, transcription and draft are refused."),
    notice("--guided-decoding-backend", "structured output runs on inflight's own llguidance integration"),
    notice("--cuda-graph-sizes", GRAPHS, "+"),
    notice("-O", GRAPHS),
    only("--num-scheduler-steps", ("1",), "one step per schedule", "multi-step scheduling is gone (from vLLM too)"),
    only("--preemption-mode", ("recompute",), "a preempted request is recomputed",
         "a preempted request is recomputed; there is no swapping"),
    notice("--num-lookahead-slots", SCHEDULER),
    switch("--enable-reasoning", REASONING, negatable=False),
    # Dropped by vLLM 0.32.0:
    refused("--override-attention-dtype", "attention runs in --dtype"),
    alias("--calculate-kv-scales", "--calculate-kv-scales", "K/V scales from the first prompt.", 0,
          negatable=True),
    notice("--max-num-partial-prefills", SCHEDULER),
    notice("--max-long-partial-prefills", SCHEDULER),
)
