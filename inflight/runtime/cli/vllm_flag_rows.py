"""Every flag of ``vllm serve`` and inflight's answer to it, as data (``FLAGS``, in ``SECTIONS``).

The rows follow vLLM 0.22.1's parser (``FrontendArgs`` in ``vllm/entrypoints/openai/cli_args.py``,
``EngineArgs.add_cli_args`` in ``vllm/engine/arg_utils.py``, the ``serve`` subcommand's own
flags) in its order, then flags of earlier releases that scripts still carry (``LEGACY``). The
kinds of answer are ``vllm_flag_kinds``; queries and the doc table are ``vllm_flags``.
"""

from __future__ import annotations

from inflight.runtime.cli.vllm_flag_kinds import (
            VllmFlag,
            alias,
            notice,
            only,
            refused,
            refused_on,
            switch,
)
from inflight.runtime.config import KERNEL_BACKENDS
from inflight.runtime.server.openai.tool_calls import TOOL_CALL_PARSERS, tool_parser_choices

VLLM_RELEASE = "0.22.1"

HUB = "inflight never downloads a model; the local directory is what is served"
ONE_NODE = ("inflight serves from one node: no data, pipeline, context or expert parallelism, "
            "no multi-node launch; run more replicas (the operator scales them)")
MOE = ("mixture-of-experts layers shard each expert's intermediate dimension over the tensor-parallel ranks: "
       "no expert parallelism, expert load balancing or routed-expert export")
MAMBA = "no Mamba or hybrid models here"
MM = "no multi-modal inputs here"
LORA = "no LoRA adapters here"
KERNELS = f"inflight runs its own kernels (--kernel-backend {'|'.join(KERNEL_BACKENDS)})"
GRAPHS = ("no torch.compile; decode steps run as CUDA graphs of inflight's own batch sizes "
          "(--enforce-eager turns them off; docs/gpu.md)")
TLS = "no TLS in the server: terminate it at a proxy or the Kubernetes ingress"
CORS = "the server sends no CORS headers: put a proxy in front for browser clients"
PLUGINS = "no plugins or custom classes"
LOG_TEXT = "request log lines never carry prompts or outputs"
DISAGG = "no disaggregated prefill, KV transfer or KV events"
QUANT = "a method's own settings: --quantization picks gguf or compressed-tensors as the checkpoint stores them"
GEN_CONFIG = ("Default auto, as in vLLM: requests that leave out temperature, top_p, top_k, min_p or "
              "repetition_penalty get the model's generation_config.json values (vllm: OpenAI's; DIR: that "
              "directory's file); a field the request sets wins. The start-up log states them. Unlike vLLM, "
              "max_new_tokens does not cap max_tokens (the log names it as not applied).")
AUTO_TOOLS = ("On by default here (vLLM's default is off): tool_choice auto is served whenever the chat "
              "template renders tools, else a 400 naming --chat-template; `--no-enable-auto-tool-choice` "
              "refuses it as vLLM does. Without `--tool-call-parser` the format is the one the template "
              "teaches (vLLM requires the parser).")
REASONING = "reasoning (<think>...</think>) goes to reasoning_content whenever the chat template uses <think>"
THINK_PARSERS = ("deepseek_r1", "qwen3", "glm45")  # vLLM's reasoning parsers of <think>...</think>
SCHEDULER = "inflight's scheduler shares each step's token budget (--max-num-tokens) between prompt chunks"
DP = "no data parallelism inside one server: run more replicas (the operator scales them)"

FRONTEND: tuple[VllmFlag, ...] = (
    refused("--headless", ONE_NODE, 0),
    only(("--api-server-count", "-asc"), ("1",), "one front-end process per server",
         "one front-end process per server; run more replicas"),
    refused("--config", "options come from the command line only; vLLM's YAML config file is not read"),
    refused("--grpc", "no gRPC server: the OpenAI HTTP API only", 0),
    refused("--lora-modules", LORA, "+"),
    alias("--chat-template", "--chat-template", "A file, a builtin name (`smollm2-tools`), or the template "
          "itself (escapes like \\n decoded, as vLLM does)."),
    only("--chat-template-content-format", ("auto", "string"),
         "message content reaches the template as a string (text parts joined)",
         "message content reaches the template as a string; the openai (list of parts) form is not implemented"),
    refused_on("--trust-request-chat-template", "a request's own chat_template is refused (400)"),
    refused("--default-chat-template-kwargs", "not implemented: send chat_template_kwargs with each request"),
    only("--response-role", ("assistant",), "the reply's role is assistant",
         "the reply's role is always assistant"),
    refused_on("--return-tokens-as-token-ids", "not implemented: logprobs name tokens by their text"),
    alias("--enable-auto-tool-choice", "--enable-auto-tool-choice", AUTO_TOOLS, 0, negatable=True),
    switch("--exclude-tools-when-tool-choice-none",
           "inflight always leaves the tools out of the prompt when tool_choice is none"),
    alias("--tool-call-parser", "--tool-call-parser", f"{', '.join(TOOL_CALL_PARSERS)}; other values are "
          "refused at start. Unset: the format the chat template teaches."),
    refused("--tool-parser-plugin", f"no plugins: {tool_parser_choices()}"),
    refused("--tool-server", "no built-in tool servers (MCP, demo)"),
    refused("--log-config-file", "logging is configured by --log-level and --log-format"),
    notice("--max-log-len", LOG_TEXT),
    refused_on("--enable-prompt-tokens-details", "not implemented: usage has no prompt_tokens_details"),
    refused_on("--enable-server-load-tracking", "no /load endpoint; /metrics has the server's load"),
    refused_on("--enable-force-include-usage", "usage comes with stream_options.include_usage only"),
    refused_on("--enable-tokenizer-info-endpoint", "no /tokenizer_info endpoint"),
    refused_on("--enable-log-outputs", LOG_TEXT),
    switch("--enable-log-deltas", LOG_TEXT),
    switch("--log-error-stack", "unhandled errors are logged with their traceback; responses never carry one"),
    refused_on("--tokens-only", "not implemented: the full OpenAI API is always served"),
    notice("--fingerprint-mode", "responses carry no system_fingerprint"),
    notice("--fingerprint-value", "responses carry no system_fingerprint"),
    alias("--host", "--host", "Default 127.0.0.1 (vLLM binds every interface)."),
    alias("--port", "--port", "Checked (0..65535, free, the host resolvable) before the model loads."),
    refused("--data-parallel-supervisor-port", DP),
    refused("--dp-supervisor-probe-interval-s", DP),
    refused("--dp-supervisor-probe-timeout-s", DP),
    refused("--dp-supervisor-probe-failure-threshold", DP),
    refused("--uds", "TCP only: no Unix domain socket"),
    alias("--uvicorn-log-level", "--log-level", "Sets inflight's whole log level; trace is debug."),
    alias("--disable-uvicorn-access-log", "--no-access-log", "", 0, negatable=True),
    alias("--disable-access-log-for-endpoints", "--access-log-exclude", "Comma-separated paths."),
    refused_on("--allow-credentials", CORS),
    refused("--allowed-origins", CORS),
    refused("--allowed-methods", CORS),
    refused("--allowed-headers", CORS),
    alias("--api-key", "--api-key", "One key (vLLM takes several).", "+"),
    refused("--ssl-keyfile", TLS),
    refused("--ssl-certfile", TLS),
    refused("--ssl-ca-certs", TLS),
    refused_on("--enable-ssl-refresh", TLS),
    refused("--ssl-cert-reqs", TLS),
    refused("--ssl-ciphers", TLS),
    refused("--root-path", "routes are served at the root; strip a path prefix at the proxy"),
    refused("--middleware", "no ASGI middleware: the server is aiohttp"),
    refused_on("--enable-request-id-headers", "not implemented: responses carry no X-Request-Id header"),
    switch("--disable-fastapi-docs", "no /docs pages are served"),
    alias("--h11-max-incomplete-event-size", "--max-header-bytes",
          "The most bytes of one request head (431 beyond); vLLM's default is 4 MiB, inflight's 64 KiB."),
    alias("--h11-max-header-count", "--max-header-count", "vLLM's default is 256, inflight's 128."),
    switch("--enable-offline-docs", "no /docs pages are served"),
    switch("--enable-flash-late-interaction", "no late-interaction (ColBERT) models here"),
)

MODEL: tuple[VllmFlag, ...] = (
    alias("--model", "--model", "A directory or a .gguf file, never a hub id."),
    only("--runner", ("auto", "generate"), "text generation only", "text generation only: no pooling or draft runners"),
    only("--convert", ("auto", "none"), "text generation only", "no conversion to embedding or classification models"),
    alias("--tokenizer", "--tokenizer", "A local directory."),
    only("--tokenizer-mode", ("auto", "hf"), "transformers' fast tokenizer",
         "transformers' fast tokenizer only (no slow or mistral_common tokenizer)"),
    switch("--trust-remote-code", "inflight runs its own decoder code; no code from the model directory is imported"),
    alias("--dtype", "--dtype", "half = float16, float = float32; auto is float32 on the CPU."),
    alias("--seed", "--seed"),
    refused("--hf-config-path", "config.json is read from the model directory"),
    refused("--allowed-local-media-path", MM),
    refused("--allowed-media-domains", MM, "+"),
    notice("--revision", HUB),
    notice("--code-revision", HUB),
    notice("--tokenizer-revision", HUB),
    alias("--max-model-len", "--max-model-len", "An integer (vLLM also takes 1k, auto). Checked against the "
          "model's config before the weights load."),
    alias(("--quantization", "-q"), "--quantization", "auto (default) | none | gguf | compressed-tensors; "
          "other methods are refused naming these (docs/quantization.md)."),
    refused("--quantization-config", QUANT),
    switch("--allow-deprecated-quantization", "no deprecated quantization methods here"),
    alias("--enforce-eager", "--enforce-eager", "No CUDA graphs for decode steps (docs/gpu.md).", 0, negatable=True),
    refused_on("--enable-return-routed-experts", MOE),
    alias("--max-logprobs", "--max-logprobs", "Default 20; -1: no ceiling but the vocabulary. Caps logprobs, "
          "top_logprobs and prompt_logprobs (a 400 naming the field above it)."),
    only("--logprobs-mode", ("raw_logprobs",),
         "logprobs are the log-softmax of the logits before temperature (after logit_bias, penalties "
         "and grammar masks when a request has them)",
         "one mode only: the log-softmax before temperature"),
    switch("--use-fp64-gumbel", "the sampler's own precision is used"),
    refused_on("--disable-sliding-window", "a sliding window is always enforced in attention"),
    switch("--disable-cascade-attn", "no cascade attention here"),
    refused_on("--skip-tokenizer-init", "the tokenizer is always loaded"),
    refused_on("--enable-prompt-embeds", "no prompt embeddings as input"),
    alias("--served-model-name", "--served-model-name", "One name (vLLM takes several).", "+"),
    only("--config-format", ("auto", "hf"), "config.json (Hugging Face format)",
         "config.json (Hugging Face format) only"),
    notice("--hf-token", HUB, "?"),
    refused("--hf-overrides", "config.json is used as it is: edit a copy of the model directory"),
    refused("--pooler-config", "no pooling models"),
    alias("--generation-config", "--generation-config", GEN_CONFIG),
    alias("--override-generation-config", "--override-generation-config", "A JSON object of those fields, "
          "on top of the file (with vllm too, as in vLLM); other keys are named in the start-up log."),
    refused_on("--enable-sleep-mode", "no sleep mode"),
    switch("--enable-cumem-allocator", "PyTorch's caching allocator is used"),
    only("--model-impl", ("auto", "vllm"), "inflight's own decoder",
         "the model runs on inflight's own decoder (the families in docs/models.md)"),
    refused("--override-attention-dtype", "attention runs in --dtype"),
    refused("--logits-processors", PLUGINS, "+"),
    refused("--io-processor-plugin", PLUGINS),
    notice("--renderer-num-workers", "templating and tokenizing run on the server's own worker pool"),
)

LOAD: tuple[VllmFlag, ...] = (
    only("--load-format", ("auto", "safetensors"), "safetensors weights",
         "safetensors weights only (or a .gguf file as the model)"),
    notice("--download-dir", HUB),
    notice("--safetensors-load-strategy", "inflight's own loader reads each shard once"),
    notice("--safetensors-prefetch-num-threads", "inflight's own loader reads each shard once"),
    notice("--safetensors-prefetch-block-size", "inflight's own loader reads each shard once"),
    refused("--model-loader-extra-config", PLUGINS),
    notice("--ignore-patterns", HUB, "+"),
    switch("--use-tqdm-on-load", "loading progress is logged per weight shard"),
    notice("--pt-load-map-location", "weights load onto --device"),
    refused("--attention-backend", KERNELS),
    notice("--mamba-backend", MAMBA),
    switch("--enable-mamba-cache-stochastic-rounding", MAMBA),
    notice("--mamba-cache-philox-rounds", MAMBA),
    only("--reasoning-parser", THINK_PARSERS, REASONING,
         "inflight splits <think>...</think> reasoning only"),
    refused("--reasoning-parser-plugin", PLUGINS),
)

PARALLEL: tuple[VllmFlag, ...] = (
    only("--distributed-executor-backend", ("mp", "uni"), "tensor-parallel ranks are processes of this node",
         "tensor-parallel ranks are processes of this node: no Ray or external launcher"),
    only(("--pipeline-parallel-size", "-pp"), ("1",), "no pipeline parallelism", ONE_NODE),
    notice("--master-addr", ONE_NODE),
    notice("--master-port", ONE_NODE),
    only(("--nnodes", "-n"), ("1",), "one node", ONE_NODE),
    only(("--node-rank", "-r"), ("0",), "one node", ONE_NODE),
    notice("--distributed-timeout-seconds", "a stalled rank is caught by --engine-stall-timeout"),
    notice("--cpu-distributed-timeout-seconds", "a stalled rank is caught by --engine-stall-timeout"),
    switch("--numa-bind", "no NUMA binding"),
    notice("--numa-bind-nodes", "no NUMA binding", "+"),
    notice("--numa-bind-cpus", "no NUMA binding", "+"),
    alias(("--tensor-parallel-size", "-tp"), "--tensor-parallel-size", "Ranks of one node."),
    only(("--decode-context-parallel-size", "-dcp"), ("1",), "no context parallelism", ONE_NODE),
    notice("--dcp-comm-backend", "no context parallelism"),
    notice("--dcp-kv-cache-interleave-size", "no context parallelism"),
    notice("--cp-kv-cache-interleave-size", "no context parallelism"),
    only(("--prefill-context-parallel-size", "-pcp"), ("1",), "no context parallelism", ONE_NODE),
    only(("--data-parallel-size", "-dp"), ("1",), "one engine per server", DP),
    refused(("--data-parallel-rank", "-dpn"), DP),
    refused(("--data-parallel-start-rank", "-dpr"), DP),
    refused(("--data-parallel-size-local", "-dpl"), DP),
    refused(("--data-parallel-address", "-dpa"), DP),
    refused(("--data-parallel-rpc-port", "-dpp"), DP),
    refused(("--data-parallel-backend", "-dpb"), DP),
    refused_on(("--data-parallel-hybrid-lb", "-dph"), DP),
    refused_on(("--data-parallel-external-lb", "-dpe"), DP),
    refused_on(("--data-parallel-multi-port-external-lb", "-dpm"), DP, negatable=False),
    refused_on(("--enable-expert-parallel", "-ep"), MOE),
    switch("--enable-ep-weight-filter", MOE),
    notice("--all2all-backend", MOE),
    switch("--enable-dbo", "no dual-batch overlap"),
    notice("--ubatch-size", "no dual-batch overlap"),
    switch("--enable-elastic-ep", MOE),
    notice("--dbo-decode-token-threshold", "no dual-batch overlap"),
    notice("--dbo-prefill-token-threshold", "no dual-batch overlap"),
    switch("--disable-nccl-for-dp-synchronization", DP),
    switch("--enable-eplb", MOE),
    notice("--eplb-config", MOE),
    notice("--expert-placement-strategy", MOE),
    notice("--max-parallel-loading-workers", "each tensor-parallel rank loads its own shard of the weights"),
    switch("--ray-workers-use-nsight", "no Ray"),
    switch("--disable-custom-all-reduce", "tensor-parallel reductions are torch.distributed's"),
    refused("--worker-cls", PLUGINS),
    refused("--worker-extension-cls", PLUGINS),
)

CACHE: tuple[VllmFlag, ...] = (
    alias("--block-size", "--block-size", "A power of two (default 16)."),
    alias("--gpu-memory-utilization", "--kv-cache-free-gpu-mem-fraction",
          "Not quite the same: vLLM's is the share of the whole GPU; ours the share of the memory "
          "still free after the weights load that becomes KV cache."),
    refused("--kv-cache-memory-bytes", "size the KV cache with --num-kv-blocks or --max-tokens-in-paged-kv-cache"),
    only("--kv-cache-dtype", ("auto",), "the KV cache is stored in the serving dtype",
         "not supported: the KV cache is stored in the serving dtype (no fp8 or int8 KV cache)"),
    alias("--num-gpu-blocks-override", "--num-kv-blocks", "Replaces the memory-based sizing."),
    alias("--enable-prefix-caching", "--enable-prefix-caching", "On by default, as in vLLM V1.", 0, negatable=True),
    notice("--prefix-caching-hash-algo", "prefix blocks are keyed by a chained SHA-256 of their token ids"),
    switch("--calculate-kv-scales", "no fp8 KV cache"),
    notice("--kv-cache-dtype-skip-layers", "no fp8 KV cache", "+"),
    switch("--kv-sharing-fast-prefill", "no cross-layer KV sharing models here"),
    notice("--mamba-cache-dtype", MAMBA),
    notice("--mamba-ssm-cache-dtype", MAMBA),
    notice("--mamba-block-size", MAMBA),
    notice("--mamba-cache-mode", MAMBA),
    refused("--kv-offloading-size", "no KV cache offloading to CPU memory"),
    notice("--kv-offloading-backend", "no KV cache offloading to CPU memory"),
    notice("--offload-backend", "no weight offloading"),
    only("--cpu-offload-gb", ("0",), "no weight offloading", "no weight offloading to CPU memory"),
    notice("--cpu-offload-params", "no weight offloading", "+"),
    only("--offload-group-size", ("0",), "no weight offloading", "no weight offloading to CPU memory"),
    notice("--offload-num-in-group", "no weight offloading"),
    notice("--offload-prefetch-step", "no weight offloading"),
    notice("--offload-params", "no weight offloading", "+"),
    switch("--language-model-only", "text-only models here"),
)

MULTIMODAL: tuple[VllmFlag, ...] = (
    notice("--limit-mm-per-prompt", MM),
    refused_on("--enable-mm-embeds", MM),
    notice("--media-io-kwargs", MM),
    notice("--mm-processor-kwargs", MM),
    notice("--mm-processor-cache-gb", MM),
    notice("--mm-processor-cache-type", MM),
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
    notice("--mm-tensor-ipc", MM),
)

LORA_FLAGS: tuple[VllmFlag, ...] = (
    refused_on("--enable-lora", LORA),
    notice("--max-loras", LORA),
    notice("--max-lora-rank", LORA),
    notice("--lora-dtype", LORA),
    switch("--enable-tower-connector-lora", LORA),
    notice("--max-cpu-loras", LORA),
    switch("--fully-sharded-loras", LORA),
    notice("--lora-target-modules", LORA, "+"),
    refused("--default-mm-loras", LORA),
    switch("--specialize-active-lora", LORA),
    switch("--enable-mixed-moe-lora-format", LORA),
)

OBSERVABILITY: tuple[VllmFlag, ...] = (
    notice("--show-hidden-metrics-for-version", "/metrics has inflight's own set (docs/metrics.md)"),
    refused("--otlp-traces-endpoint", "no OpenTelemetry tracing"),
    refused("--collect-detailed-traces", "no OpenTelemetry tracing", "+"),
    switch("--kv-cache-metrics", "/metrics has inflight's own KV cache metrics (docs/metrics.md)"),
    notice("--kv-cache-metrics-sample", "/metrics has inflight's own KV cache metrics (docs/metrics.md)"),
    switch("--cudagraph-metrics", "decode-graph captures are reported in the load log"),
    switch("--enable-layerwise-nvtx-tracing", "no NVTX ranges"),
    switch("--enable-mfu-metrics", "no MFU metrics"),
    switch("--enable-logging-iteration-details", "the stats line is the engine's periodic log"),
)

SCHEDULER_FLAGS: tuple[VllmFlag, ...] = (
    alias("--max-num-batched-tokens", "--max-num-tokens", "The token budget of one step. Live-tunable."),
    alias("--max-num-seqs", "--max-num-sequences", "Live-tunable."),
    notice("--max-num-partial-prefills", SCHEDULER),
    notice("--max-long-partial-prefills", SCHEDULER),
    alias("--long-prefill-token-threshold", "--long-prefill-token-threshold",
          "Caps a chunked prompt's tokens per step; 0 turns the cap off. Under --scheduler-policy fair it caps "
          "one tenant's prompt tokens per step and defaults to --max-num-tokens / 8."),
    alias("--scheduling-policy", "--scheduler-policy", "inflight also has fair and static; a request's "
          "priority is refused (400) under fcfs and static."),
    alias("--enable-chunked-prefill", "--enable-chunked-context", "On by default.", 0, negatable=True),
    switch("--disable-chunked-mm-input", MM),
    refused("--scheduler-cls", PLUGINS),
    switch("--scheduler-reserve-full-isl", SCHEDULER),
    switch("--disable-hybrid-kv-cache-manager", "one kind of KV cache here"),
    alias("--async-scheduling", "--async-scheduling", "Prepare step N+1 while step N runs (docs/gpu.md).", 0,
          negatable=True),
    only("--stream-interval", ("1",), "streams send every step's tokens", "streams send every step's tokens"),
)

COMPILATION: tuple[VllmFlag, ...] = (
    notice("--cudagraph-capture-sizes", GRAPHS, "+"),
    notice("--max-cudagraph-capture-size", GRAPHS),
    notice("--ir-op-priority", KERNELS),
    switch("--enable-flashinfer-autotune", KERNELS),
    notice("--moe-backend", MOE),
    notice("--linear-backend", KERNELS),
)

ENGINE: tuple[VllmFlag, ...] = (
    alias(("--speculative-config", "-sc"), "--speculative-config",
          "n-gram (prompt lookup), or a draft model that shares the tokenizer (method draft_model)."),
    refused("--spec-method", "use --speculative-config '{\"method\": \"ngram\" or \"draft_model\", ...}'"),
    refused("--spec-model", "use --speculative-config '{\"method\": \"draft_model\", \"model\": DIR}'"),
    refused("--spec-tokens", "use --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": N}'"),
    refused("--kv-transfer-config", DISAGG),
    refused("--kv-events-config", DISAGG),
    refused("--ec-transfer-config", DISAGG),
    notice(("--compilation-config", "-cc"), GRAPHS),
    notice(("--attention-config", "-ac"), KERNELS),
    notice("--reasoning-config", REASONING),
    notice("--kernel-config", KERNELS),
    notice("--additional-config", PLUGINS),
    notice("--structured-outputs-config", "structured output runs on inflight's own llguidance integration"),
    refused("--profiler-config", "no profiler endpoints"),
    notice("--optimization-level", GRAPHS),
    notice("--performance-mode", "tune with --max-num-sequences and --max-num-tokens (docs/tuning.md)"),
    refused("--weight-transfer-config", "no weight-transfer endpoints"),
    alias("--disable-log-stats", "--no-stats-log", "", 0),
    switch("--aggregate-engine-logging", DP, negatable=False),
    switch("--fail-on-environ-validation", "no environment validation step"),
    alias("--shutdown-timeout", "--drain-timeout", "vLLM's default is 0 (abort at once); inflight's is 30 s."),
    notice("--gdn-prefill-backend", "no gated-delta-net models here"),
    switch("--enable-log-requests", "inflight logs one line per finished request (no prompt or output) and "
           "one access line per HTTP request (--no-access-log turns those off)"),
)

LEGACY: tuple[VllmFlag, ...] = (
    alias("--disable-log-requests", "--no-access-log", "Turns off the access log.", 0, negatable=True),
    notice("--swap-space", "no CPU swap space: a preempted request is recomputed, as in vLLM V1"),
    alias("--disable-frontend-multiprocessing", "--single-process", "", 0),
    notice("--max-seq-len-to-capture", GRAPHS),
    only("--task", ("auto", "generate"), "text generation only", "text generation only"),
    notice("--guided-decoding-backend", "structured output runs on inflight's own llguidance integration"),
    notice("--cuda-graph-sizes", GRAPHS, "+"),
    notice("-O", GRAPHS),
    only("--num-scheduler-steps", ("1",), "one step per schedule", "multi-step scheduling is gone (from vLLM too)"),
    only("--preemption-mode", ("recompute",), "a preempted request is recomputed",
         "a preempted request is recomputed; there is no swapping"),
    notice("--num-lookahead-slots", SCHEDULER),
    switch("--enable-reasoning", REASONING, negatable=False),
)

SECTIONS: tuple[tuple[str, tuple[VllmFlag, ...]], ...] = (
    ("Frontend", FRONTEND), ("Model", MODEL), ("Load", LOAD), ("Parallel", PARALLEL), ("Cache", CACHE),
    ("Multi-modal", MULTIMODAL), ("LoRA", LORA_FLAGS), ("Observability", OBSERVABILITY),
    ("Scheduler", SCHEDULER_FLAGS), ("Compilation", COMPILATION), ("Engine", ENGINE),
    (f"Earlier releases (before {VLLM_RELEASE})", LEGACY),
)
FLAGS: tuple[VllmFlag, ...] = tuple(flag for _, rows in SECTIONS for flag in rows)
