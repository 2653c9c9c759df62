"""The hand-written server flags of ``inflight serve`` (--model, --host, --port, keys, timeouts,
connection limits, logging) and their value parsers; each default is read from
``ServerSettings`` or ``ConnectionLimits``, never typed a second time. The engine flags are
generated from ``EngineConfig`` in :mod:`.command`. Knows nothing about serving.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from inflight import env_vars
from inflight.runtime.cli import preflight
from inflight.runtime.cli import vllm_aliases as cli_vllm
from inflight.runtime.generation_defaults import AUTO, SAMPLING_FIELDS, parse_override
from inflight.runtime.server.event_loop import EVENT_LOOPS
from inflight.runtime.server.lora import LoRAModule, parse_lora_module
from inflight.runtime.server.openai.tool_calls import TOOL_CALL_PARSERS, tool_parser_choices
from inflight.runtime.server.responses_api.store import DEFAULT_MAX_ENTRIES
from inflight.runtime.server.state import PREFIX_CACHE_ISOLATION, ServerSettings
from inflight.runtime.server.transport import ConnectionLimits

API_KEY_ENV = "INFLIGHT_API_KEY"
ADMIN_API_KEY_ENV = "INFLIGHT_ADMIN_API_KEY"
METRICS_API_KEY_ENV = "INFLIGHT_METRICS_API_KEY"
SINGLE_PROCESS_ENV = "INFLIGHT_SINGLE_PROCESS"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


def flag_names(flag: str) -> tuple[str, ...]:
    """``flag`` and the vLLM spellings shown beside it in ``--help``."""
    return (flag, *cli_vllm.visible_aliases(flag))


def add_server_flags(server: argparse._ArgumentGroup) -> None:
    server.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="Same as --model (vLLM's positional form).")
    server.add_argument("--model", default=None,
                        help="Local Hugging Face model directory, or a .gguf file (converted once "
                             "into a cache directory).")
    server.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="Take the tokenizer (and its chat template) from this local directory instead.")
    server.add_argument("--chat-template", default=None, metavar="FILE|NAME|TEMPLATE",
                        help="The chat template to use instead of the tokenizer's: a file, a builtin "
                             "(smollm2-tools: SmolLM2's with Hermes-style tools), or the Jinja template itself.")
    server.add_argument(*flag_names("--lora-modules"), nargs="+", type=_lora_module, default=None,
                        metavar="NAME=PATH|JSON",
                        help="LoRA adapters (PEFT directories) loaded before the server says ready, each "
                             "served under its name as a request's model (needs --enable-lora): name=path, or "
                             "vLLM's JSON form '{\"name\": \"x\", \"path\": \"/p\", \"base_model_name\": "
                             "\"m\"}' (base_model_name: the parent /v1/models names). A refused adapter fails "
                             "the start with its reason.")
    server.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
                        help="Serve tool_choice 'auto' (and tools without a tool_choice). On unless "
                             "--no-enable-auto-tool-choice, which refuses it as vLLM does by default.")
    server.add_argument("--tool-call-parser", default=None, type=_tool_call_parser, metavar="NAME",
                        help=f"The format tool_choice 'auto' replies are parsed in: "
                             f"{', '.join(TOOL_CALL_PARSERS)} (unset: the one the chat template teaches).")
    server.add_argument("--enable-responses-store", action="store_true",
                        help="Keep finished /v1/responses in memory (least recently used out first) for "
                             "previous_response_id and GET /v1/responses/{id} (vLLM's "
                             "VLLM_ENABLE_RESPONSES_API_STORE). Off: previous_response_id is a 400.")
    server.add_argument("--responses-store-size", type=_positive_int, default=None, metavar="N",
                        help=f"The most responses the store keeps (default {DEFAULT_MAX_ENTRIES}); "
                             "enables the store too.")
    server.add_argument("--generation-config", default=AUTO, metavar="auto|vllm|DIR",
                        help=f"What requests get for the sampling fields they leave out ({', '.join(SAMPLING_FIELDS)}): "
                             "auto (vLLM's default too): the model's generation_config.json; vllm: OpenAI's, "
                             "ignoring the file; DIR: the generation_config.json in DIR. The start-up log "
                             "states them; a field a request sets always wins.")
    server.add_argument("--override-generation-config", type=_generation_override, default=None, metavar="JSON",
                        help="Sampling defaults that replace the generation config's, e.g. "
                             "'{\"temperature\": 0.5}' (with --generation-config vllm too).")
    server.add_argument("--max-logprobs", type=_max_logprobs, default=_server_default("max_logprobs"), metavar="N",
                        help="The most logprobs / top_logprobs / prompt_logprobs a request may ask for "
                             "(400 above it; -1: no ceiling but the vocabulary).")
    server.add_argument(*flag_names("--host"), default="127.0.0.1", help="Address to bind.")
    server.add_argument(*flag_names("--port"), type=_port, default=8000, help="Port to bind (0: any free port).")
    server.add_argument(*flag_names("--served-model-name"), default=None,
                        help="Model name clients send (default: the --model argument).")
    server.add_argument(*flag_names("--api-key"), default=None,
                        help=f"Require 'Authorization: Bearer KEY' on /v1 (env {API_KEY_ENV}).")
    server.add_argument("--admin-api-key", default=None,
                        help=f"Enable /admin, with 'Authorization: Bearer KEY' (env {ADMIN_API_KEY_ENV}); "
                             "/admin is off without it and --api-key never grants it.")
    server.add_argument("--priority-floor", type=int, default=None, metavar="N",
                        help="The most urgent 'priority' a request may ask for without --priority-api-key "
                             "(lower is served first; below N is a 400). Unset: any priority. Only "
                             "--scheduler-policy priority and fair honour priorities at all.")
    server.add_argument("--priority-api-key", default=None, metavar="KEY",
                        help="The trusted caller's key: accepted wherever --api-key is, and its requests may "
                             "ask for any priority (see --priority-floor).")
    server.add_argument("--metrics-api-key", default=None, metavar="KEY",
                        help=f"The key GET /metrics requires, e.g. Prometheus' bearer token (env {METRICS_API_KEY_ENV}); "
                             "the admin key is accepted too, inference keys no longer are. Without it /metrics "
                             "answers to the server's keys when --api-key is set, and to anyone when it is not.")
    server.add_argument("--open-metrics", action="store_true", default=False,
                        help="Serve /metrics to anyone even with --api-key (for scrapers that cannot send a "
                             "key); the prefix-cache counters then help guess other users' prompts unless "
                             "--prefix-cache-isolation key or per-user cache_salt separates them.")
    server.add_argument("--prefix-cache-isolation", default=_server_default("prefix_cache_isolation"),
                        choices=PREFIX_CACHE_ISOLATION,
                        help="none: requests share prefix-cache blocks unless their cache_salt differs; key: each "
                             "API key (each peer address without --api-key) gets a cache of its own, so no caller "
                             "can probe another's prompts through hits or time to first token; tenant: each "
                             "tenant a gateway names in --tenant-header (else each key) gets its own.")
    server.add_argument("--tenant-header", default=None, metavar="NAME",
                        help="Under --scheduler-policy fair, the request header a trusted gateway names the tenant "
                             "in (e.g. llm-d's x-gateway-inference-fairness-id); requests without it are the "
                             "caller's. Unset: a tenant is an API key (a peer address without --api-key), and a "
                             "request's user only divides its tenant's share. Only where clients cannot reach the "
                             "server but through the gateway.")
    server.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                        help='Images a chat prompt may carry, vLLM\'s JSON: {"image": N} (default 4; 0 refuses '
                             "images). Vision-language models only (docs/vision.md).")
    server.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                        help="Let image_url parts name file:// paths under DIR (default: none; data URLs only).")
    server.add_argument("--reject-unknown-fields", action="store_true", default=False,
                        help="Answer a request field this server does not know with OpenAI's own 400 "
                             "('Unrecognized request argument supplied: max_token', the near miss suggested) "
                             "instead of ignoring it; ignored fields are always logged once per name and named "
                             "in the x-inflight-ignored-fields response header.")
    server.add_argument("--engine-stall-timeout", type=float, default=_server_default("engine_stall_timeout_s"),
                        help="Seconds one engine step may run, or an idle engine may go without answering "
                             "its heartbeat (a core frozen between steps, e.g. by SIGSTOP), before the server "
                             "declares the engine dead, answers every client with 503 and exits non-zero.")
    server.add_argument("--keepalive-timeout", type=float, default=_server_default("keepalive_timeout_s"),
                        help="Seconds before an idle connection is closed (a request head that has begun "
                             "must end within --header-timeout).")
    server.add_argument("--header-timeout", type=float, default=_limit_default("header_timeout_s"),
                        help="Seconds a client has to send a whole request head, from its first byte (from "
                             "connecting, for a connection's first request); the connection is closed after.")
    server.add_argument("--max-connections", type=int, default=_limit_default("max_connections"), metavar="N",
                        help="Connections open at once; one more is answered 503 and closed unread (the "
                             "soft open-file limit is raised to fit).")
    server.add_argument(*flag_names("--max-header-bytes"), type=int, default=_limit_default("max_header_bytes"),
                        metavar="BYTES", help="The most bytes of one request head (request line and headers) "
                                              "the server reads; 431 beyond. One line or header: 8190 bytes.")
    server.add_argument(*flag_names("--max-header-count"), type=int, default=_limit_default("max_header_count"),
                        metavar="N", help="The most headers one request may have (400 beyond).")
    server.add_argument("--request-read-timeout", type=float, default=_server_default("request_read_timeout_s"),
                        help="Seconds a request body may take to arrive (408 after).")
    server.add_argument("--stream-write-timeout", type=float, default=_server_default("stream_write_timeout_s"),
                        help="Seconds a stream may wait for its client to read before it is cut "
                             "and its requests aborted.")
    server.add_argument("--stream-interval", type=int, default=_server_default("stream_interval"), metavar="N",
                        help="Tokens a streamed chunk waits for before it is sent (its first token and its last "
                             "chunk go at once). A stream that falls behind sends what piled up in one chunk.")
    server.add_argument(*flag_names("--api-server-count"), type=int, default=_server_default("api_server_count"),
                        metavar="N", help="Front-end processes (HTTP, tokenizing, detokenizing, streaming) "
                                          "sharing the port over one engine core.")
    server.add_argument("--event-loop", default=_server_default("event_loop"), choices=EVENT_LOOPS,
                        help="Each front end's event loop: auto (uvloop where installed, else asyncio), uvloop "
                             "(an error at start without it) or asyncio. The start-up log names the one used.")
    server.add_argument(*flag_names("--drain-timeout"), type=float, default=_server_default("drain_timeout_s"),
                        help="Seconds to let requests in flight finish after SIGTERM or the first Ctrl-C.")
    server.add_argument(*flag_names("--log-level"), default="info", choices=LOG_LEVELS,
                        type=cli_vllm.value_type("log_level"), help="Log level.")
    server.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text: one readable line per event; json: one JSON object per line.")
    server.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                        help="One log line per HTTP request, refused ones included: method, path, status, "
                             "latency, request id (never a body or a key).")
    server.add_argument("--access-log-exclude", default="", metavar="PATHS",
                        help="Comma-separated paths left out of the access log (e.g. /health,/metrics).")
    server.add_argument("--stats-log", action=argparse.BooleanOptionalAction, default=True,
                        help="The periodic engine stats line while busy.")
    server.add_argument("--headless", action="store_true", default=False,
                        help="Run this node's ranks of a multi-node group (--nnodes, --node-rank K > 0) and no "
                             "HTTP server (docs/multi-node.md).")
    server.add_argument(*flag_names("--single-process"), action="store_true",
                        default=env_vars.read_bool(SINGLE_PROCESS_ENV),
                        help="Run the engine in a thread of the server process instead of an engine-core "
                             f"process of its own (for debugging; env {SINGLE_PROCESS_ENV}=1).")


def _lora_module(text: str) -> LoRAModule:
    try:
        return parse_lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tool_call_parser(text: str) -> str:
    if text not in TOOL_CALL_PARSERS:
        raise argparse.ArgumentTypeError(f"{text!r}: {tool_parser_choices()}")
    return text


def _generation_override(text: str) -> dict[str, Any]:
    try:
        return parse_override(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _max_logprobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -2
    if value < -1:
        raise argparse.ArgumentTypeError(f"{text!r}: use an integer >= 0, or -1 for no ceiling")
    return value


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= preflight.MAX_PORT:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: use 1..{preflight.MAX_PORT} (0: any free port)")
    return port


def _server_default(name: str) -> Any:
    """The ``ServerSettings`` default of ``name`` (the one copy of it)."""
    return next(f.default for f in dataclasses.fields(ServerSettings) if f.name == name)


def _limit_default(name: str) -> Any:
    """The ``ConnectionLimits`` default of ``name`` (the one copy of it)."""
    return next(f.default for f in dataclasses.fields(ConnectionLimits) if f.name == name)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value}")
    return value
