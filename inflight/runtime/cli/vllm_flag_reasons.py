"""The reasons the vLLM flag ledger (:mod:`.vllm_flag_rows`) gives again and again: why a family of
``vllm serve`` flags is refused or answered differently here, one sentence each, so every row
that shares a reason shares its words. Data only.
"""

from __future__ import annotations

from inflight.runtime.config import KERNEL_BACKENDS

HUB = "inflight never downloads a model; the local directory is what is served"
ONE_NODE = ("inflight splits a model by tensor and pipeline parallelism only: no data, context or expert "
            "parallelism; run more replicas (the operator scales them)")
MOE = ("mixture-of-experts layers shard each expert's intermediate dimension over the tensor-parallel ranks: "
       "no expert parallelism, expert load balancing or routed-expert export")
MAMBA = "no Mamba or hybrid models here"
MM = "images in chat only, for Qwen2.5-VL (docs/vision.md): no such knob here"
LORA_KERNEL = "one LoRA kernel serves every batch (Punica-style, rows grouped by adapter slot)"
LORA_MOE = "LoRA adapters apply to attention and dense MLP projections; not to mixture-of-experts experts"
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
REASONING = ("reasoning goes to reasoning_content by the chat template's format: <think>...</think> whenever "
             "the template uses <think>, harmony's analysis channel for a gpt-oss (harmony) template")
# vLLM's reasoning parsers of <think>...</think>, and of gpt-oss's harmony channels.
THINK_PARSERS = ("deepseek_r1", "deepseek_v3", "qwen3", "glm45", "kimi_k2", "openai_gptoss")
SCHEDULER = "inflight's scheduler shares each step's token budget (--max-num-tokens) between prompt chunks"
DP = "no data parallelism inside one server: run more replicas (the operator scales them)"
METRICS = "/metrics has inflight's own set (docs/metrics.md)"
SLEEP = "no sleep mode"
