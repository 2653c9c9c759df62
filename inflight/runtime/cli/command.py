"""The ``inflight`` command line: ``inflight serve --model DIR ...``.

Owns the argument parser. Engine flags are generated from ``EngineConfig``'s fields (name
with dashes, the field's help text, the dataclass default; bools as ``--x/--no-x``), so a
new engine knob becomes a flag with no edit here and no second copy of a default. Server
flags (--model, --host, --port, ...) are the only hand-written ones. Every flag of ``vllm
serve`` is answered (``vllm_flags``, wired by ``cli_vllm``): an alias of an inflight flag, a
notice, or a refusal naming why; any other flag is a usage error with the closest known flag;
abbreviations are off. Before anything heavy it checks what a user gets wrong on day one, each
reported in one line: a bad value (with ``serve``'s usage), then, through ``preflight``, a port
out of range or a host that does not resolve, a model path that is not a model, a port in use,
a tokenizer that does not load, a ``--max-model-len`` past the model's, a KV cache smaller than
one sequence. A ``.gguf``
model is converted once into a cached directory (``gguf_source``); ``--tokenizer`` and
``--chat-template`` (a file, a builtin name from ``chat_templates``, or the template itself) are
served through an overlay of the model directory (``serving_dir``). ``--generation-config`` and
``--override-generation-config`` become the sampling defaults of ``ServerSettings``
(``generation_defaults``), read before any weight loads. The engine-core process starts as
soon as the directory to serve is known, so its imports overlap those checks; it loads the
model only once they pass, and a refused start kills it.
Knows nothing about HTTP handling: it builds ``EngineConfig`` and ``ServerSettings`` and calls
``serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import typing
from collections.abc import Sequence
from typing import Any

from inflight import __version__, env_vars
from inflight.runtime.cli import preflight
from inflight.runtime.cli import vllm_aliases as cli_vllm
from inflight.runtime.config import EngineConfig
from inflight.runtime.generation_defaults import AUTO, SAMPLING_FIELDS, parse_override
from inflight.runtime.server.openai.tool_calls import TOOL_CALL_PARSERS, tool_parser_choices
from inflight.runtime.server.state import PREFIX_CACHE_ISOLATION, ServerSettings
from inflight.runtime.server.transport import ConnectionLimits

API_KEY_ENV = "INFLIGHT_API_KEY"
ADMIN_API_KEY_ENV = "INFLIGHT_ADMIN_API_KEY"
METRICS_API_KEY_ENV = "INFLIGHT_METRICS_API_KEY"
SINGLE_PROCESS_ENV = "INFLIGHT_SINGLE_PROCESS"
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")

logger = logging.getLogger("inflight.cli")


class HelpFormatter(argparse.HelpFormatter):
    """Adds ``(default: X)`` once, and only where it tells something: not for None or off, not
    where the help text already speaks of the default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or "default" in text.lower() or not action.option_strings:
            return text
        if action.default is None or action.default is False or action.default in ("", argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description="In-flight batching LLM server.",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"inflight {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="serve a model over the OpenAI HTTP API", allow_abbrev=False, formatter_class=HelpFormatter,
        epilog=f"vLLM's serve flags are accepted as aliases, with a notice, or refused with the reason: "
               f"{cli_vllm.DOC} lists each.",
    )
    add_server_flags(serve.add_argument_group("server"))
    add_engine_flags(serve.add_argument_group("engine"))
    cli_vllm.add_vllm_flags(serve)
    return parser


def _names(flag: str) -> tuple[str, ...]:
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
    server.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
                        help="Serve tool_choice 'auto' (and tools without a tool_choice). On unless "
                             "--no-enable-auto-tool-choice, which refuses it as vLLM does by default.")
    server.add_argument("--tool-call-parser", default=None, type=_tool_call_parser, metavar="NAME",
                        help=f"The format tool_choice 'auto' replies are parsed in: "
                             f"{', '.join(TOOL_CALL_PARSERS)} (unset: the one the chat template teaches).")
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
    server.add_argument(*_names("--host"), default="127.0.0.1", help="Address to bind.")
    server.add_argument(*_names("--port"), type=_port, default=8000, help="Port to bind (0: any free port).")
    server.add_argument(*_names("--served-model-name"), default=None,
                        help="Model name clients send (default: the --model argument).")
    server.add_argument(*_names("--api-key"), default=None,
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
    server.add_argument(*_names("--max-header-bytes"), type=int, default=_limit_default("max_header_bytes"),
                        metavar="BYTES", help="The most bytes of one request head (request line and headers) "
                                              "the server reads; 431 beyond. One line or header: 8190 bytes.")
    server.add_argument(*_names("--max-header-count"), type=int, default=_limit_default("max_header_count"),
                        metavar="N", help="The most headers one request may have (400 beyond).")
    server.add_argument("--request-read-timeout", type=float, default=_server_default("request_read_timeout_s"),
                        help="Seconds a request body may take to arrive (408 after).")
    server.add_argument("--stream-write-timeout", type=float, default=_server_default("stream_write_timeout_s"),
                        help="Seconds a stream may wait for its client to read before it is cut "
                             "and its requests aborted.")
    server.add_argument(*_names("--drain-timeout"), type=float, default=_server_default("drain_timeout_s"),
                        help="Seconds to let requests in flight finish after SIGTERM or the first Ctrl-C.")
    server.add_argument(*_names("--log-level"), default="info", choices=LOG_LEVELS,
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
    server.add_argument(*_names("--single-process"), action="store_true",
                        default=env_vars.read_bool(SINGLE_PROCESS_ENV),
                        help="Run the engine in a thread of the server process instead of an engine-core "
                             f"process of its own (for debugging; env {SINGLE_PROCESS_ENV}=1).")


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


def add_engine_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per ``EngineConfig`` field, typed from its annotation."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind, optional = _flag_type(hints[f.name])
        flags = _names("--" + f.name.replace("_", "-"))
        default = f.default if f.default is not dataclasses.MISSING else argparse.SUPPRESS
        help_text = f.metadata.get("help", "")
        if optional and kind not in (int, str):
            raise TypeError(f"EngineConfig.{f.name}: only Optional[int] and Optional[str] fields have a flag form")
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, type=cli_vllm.value_type(f.name, kind), default=default,
                               help=help_text, metavar="N" if kind in (int, float) else "VALUE")


def _flag_type(hint: Any) -> tuple[type, bool]:
    """(the flag's value type, whether None is allowed) for a field annotation."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:
        if len(args) != 1:
            raise TypeError(f"unsupported EngineConfig annotation for a flag: {hint!r}")
        return args[0], True
    return hint, False


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed flags describe (raises ``ValueError`` on bad values)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**values)


def server_settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Server settings from the flags; ``INFLIGHT_API_KEY`` stands in for a missing --api-key."""
    return ServerSettings(
        model_name=args.served_model_name or args.model,
        api_key=args.api_key or env_vars.read_str(API_KEY_ENV) or None,
        admin_api_key=args.admin_api_key or env_vars.read_str(ADMIN_API_KEY_ENV) or None,
        drain_timeout_s=args.drain_timeout,
        engine_stall_timeout_s=args.engine_stall_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        request_read_timeout_s=args.request_read_timeout,
        stream_write_timeout_s=args.stream_write_timeout,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        max_logprobs=args.max_logprobs,
        priority_floor=args.priority_floor,
        priority_api_key=args.priority_api_key,
        connection_limits=ConnectionLimits(
            max_connections=args.max_connections, max_header_bytes=args.max_header_bytes,
            max_header_count=args.max_header_count, header_timeout_s=args.header_timeout),
        metrics_api_key=args.metrics_api_key or env_vars.read_str(METRICS_API_KEY_ENV) or None,
        open_metrics=args.open_metrics,
        prefix_cache_isolation=args.prefix_cache_isolation,
        tenant_header=args.tenant_header,
    )


def access_log_from_args(args: argparse.Namespace) -> Any:
    from inflight.runtime.logs import AccessLog

    exclude = frozenset(p.strip() for p in args.access_log_exclude.split(",") if p.strip())
    return AccessLog(enabled=args.access_log, exclude=exclude)


def _import_front_end() -> None:
    """Import what the checks and the server import anyway (transformers' tokenizer base
    classes, the HTTP server): done while the engine-core process prewarms, not after."""
    import transformers.tokenization_utils_tokenizers  # noqa: F401 - every fast tokenizer's base

    import inflight.runtime.server.serve  # noqa: F401 - aiohttp and the app


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser, notices: list[str]) -> int:
    from inflight.runtime.cli.serving_dir import tokenizer_dir_problem
    from inflight.runtime.core.stats_log import start_stats_log
    from inflight.runtime.generation_defaults import load_sampling_defaults, source_problem
    from inflight.runtime.logs import configure_logging
    from inflight.runtime.model.gguf_source import model_dir_problem

    try:
        config = engine_config_from_args(args)
        settings = server_settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    problem = model_dir_problem(args.model) or preflight.host_problem(args.host)
    if problem is None and args.tokenizer is not None:
        problem = tokenizer_dir_problem(args.tokenizer)
    problem = problem or source_problem(args.generation_config)
    if problem:
        parser.error(problem)
    in_use = preflight.port_problem(args.host, args.port)
    if in_use:
        print(f"inflight serve: error: {in_use}", file=sys.stderr)
        return 1
    configure_logging(args.log_level, args.log_format)
    for line in notices:
        logger.warning("%s", line)
    progress = logging.getLogger("inflight.loading")
    core = None
    try:
        model_dir = preflight.served_dir(args, progress.info)
        if not args.single_process:
            # started before the checks below, which take what they need of the model from it
            # (so this process never imports torch); it loads nothing until the server sends
            # Go, and a refused start kills it
            from inflight.runtime.engine_core.core import CoreLaunch
            from inflight.runtime.server.engine_process import CoreProcess

            core = CoreProcess(CoreLaunch(str(model_dir), config, args.log_level, args.log_format,
                                          stats_log=args.stats_log))
            core.start()
        _import_front_end()  # while the core prewarms
        facts = core.served_facts() if core is not None else None  # single process: read here
        tokenizer = preflight.check_served(args, config, model_dir, facts)
        if core is not None:
            core.tokenizer = tokenizer
        settings = dataclasses.replace(settings, sampling_defaults=load_sampling_defaults(
            args.generation_config, model_dir, args.override_generation_config))
    except ValueError as exc:
        if core is not None:
            core.kill()
        print(f"inflight serve: error: {exc}", file=sys.stderr)
        return 1
    except BaseException:
        if core is not None:
            core.kill()
        raise

    def load() -> Any:  # --single-process: the core's own load, on the engine thread
        from inflight.runtime.engine_core.core import CoreLaunch, load_engine

        engine = load_engine(CoreLaunch(str(model_dir), config), tokenizer)
        if args.stats_log:
            start_stats_log(engine.stats)
        return engine

    from inflight.runtime.server.serve import serve

    source: Any = load if core is None else core
    try:
        return asyncio.run(serve(settings, source, args.host, args.port, access_log_from_args(args)))
    finally:
        if core is not None:
            core.kill()  # a server that stopped before its engine started leaves no waiting core


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(cli_vllm.normalize_argv(sys.argv[1:] if argv is None else argv))
    if args.command != "serve":
        parser.error(f"unknown command {args.command!r}")
    serve_parser = _serve_parser(parser)
    if extras:
        serve_parser.error(cli_vllm.unknown_flags_message(extras, serve_parser))
    if args.model and args.model_path and args.model != args.model_path:
        serve_parser.error(f"two models given: {args.model_path} and --model {args.model}")
    args.model = args.model or args.model_path
    if not args.model:
        serve_parser.error("the model is required: inflight serve MODEL (or --model MODEL)")
    notices, refusal = cli_vllm.check_given(args)
    if refusal:
        serve_parser.error(refusal)
    try:
        return _serve(args, serve_parser, notices)
    except KeyboardInterrupt:  # Ctrl-C before the server runs (while converting or checking)
        print("inflight serve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
