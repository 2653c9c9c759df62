"""The ``inflight`` command line: ``inflight serve --model DIR ...``.

Owns the argument parser. Engine flags are generated from ``EngineConfig``'s fields (name
with dashes, the field's help text, the dataclass default; bools as ``--x/--no-x``), so a
new engine knob becomes a flag with no edit here and no second copy of a default. Server
flags (--model, --host, --port, ...: :mod:`.server_flags`) are the only hand-written ones. Every flag of ``vllm
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
import dataclasses
import logging
import sys
import typing
from collections.abc import Sequence
from typing import Any

from inflight import __version__, env_vars
from inflight.runtime.cli import preflight
from inflight.runtime.cli import vllm_aliases as cli_vllm
from inflight.runtime.cli.server_flags import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    METRICS_API_KEY_ENV,
    add_server_flags,
    flag_names,
)
from inflight.runtime.config import EngineConfig
from inflight.runtime.logs import startup_error_line
from inflight.runtime.multimodal.media import media_limits_from_flags
from inflight.runtime.server.responses_api.store import DEFAULT_MAX_ENTRIES
from inflight.runtime.server.state import ServerSettings
from inflight.runtime.server.transport import ConnectionLimits

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


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are one JSON log line with ``json_errors`` (``--log-format
    json``), as every later start-up error is."""

    def __init__(self, *args: Any, json_errors: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.json_errors = json_errors

    def error(self, message: str) -> typing.NoReturn:
        if not self.json_errors:
            super().error(message)
        print(startup_error_line(message, "json"), file=sys.stderr)
        sys.exit(2)


def build_parser(json_errors: bool = False) -> argparse.ArgumentParser:
    parser = Parser(prog="inflight", description="In-flight batching LLM server.", allow_abbrev=False,
                    json_errors=json_errors)
    parser.add_argument("--version", action="version", version=f"inflight {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="serve a model over the OpenAI HTTP API", allow_abbrev=False, formatter_class=HelpFormatter,
        json_errors=json_errors,
        epilog=f"vLLM's serve flags are accepted as aliases, with a notice, or refused with the reason: "
               f"{cli_vllm.DOC} lists each.",
    )
    add_server_flags(serve.add_argument_group("server"))
    add_engine_flags(serve.add_argument_group("engine"))
    cli_vllm.add_vllm_flags(serve)
    return parser


def add_engine_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per ``EngineConfig`` field, typed from its annotation."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind, optional = _flag_type(hints[f.name])
        flags = flag_names("--" + f.name.replace("_", "-"))
        default = f.default if f.default is not dataclasses.MISSING else argparse.SUPPRESS
        help_text = f.metadata.get("help", "")
        if optional and kind not in (int, float, str, bool):  # Optional[bool]: unset is auto
            raise TypeError(f"EngineConfig.{f.name}: only Optional[int], Optional[float], Optional[str] and "
                            "Optional[bool] fields have a flag form")
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
        stream_interval=args.stream_interval,
        api_server_count=args.api_server_count,
        event_loop=args.event_loop,
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
        responses_store_size=args.responses_store_size or (DEFAULT_MAX_ENTRIES if args.enable_responses_store else 0),
        reject_unknown_fields=args.reject_unknown_fields,
        media_limits=media_limits_from_flags(args.limit_mm_per_prompt, args.allowed_local_media_path),
        lora_modules=tuple(args.lora_modules or ()),
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


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser, notices: list[str],
           ready_checks: Sequence[Any] = ()) -> int:
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
    if settings.lora_modules and not config.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    from inflight.runtime.server.event_loop import EventLoopUnavailableError, loop_factory

    try:
        loop_factory(settings.event_loop)  # --event-loop uvloop without uvloop: refused before anything starts
    except EventLoopUnavailableError as exc:
        parser.error(str(exc))
    if args.headless:  # another node's ranks of a multi-node group: no front end (distributed/headless.py)
        from inflight.runtime.distributed.headless import run_headless

        configure_logging(args.log_level, args.log_format)
        try:
            return run_headless(args.model, config)
        except (ValueError, RuntimeError) as exc:
            print(startup_error_line(str(exc), args.log_format), file=sys.stderr)
            return 1
    problem = model_dir_problem(args.model) or preflight.host_problem(args.host)
    if problem is None and args.tokenizer is not None:
        problem = tokenizer_dir_problem(args.tokenizer)
    problem = problem or source_problem(args.generation_config)
    if problem:
        parser.error(problem)
    if settings.api_server_count > 1 and args.single_process:
        parser.error(f"--api-server-count {settings.api_server_count} needs the engine-core process: "
                     "several front ends cannot share an engine that runs on a thread of one (--single-process)")
    in_use = preflight.port_problem(args.host, args.port)
    if in_use:
        print(startup_error_line(in_use, args.log_format), file=sys.stderr)
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
                                          stats_log=args.stats_log), settings.api_server_count)
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
        print(startup_error_line(str(exc), args.log_format), file=sys.stderr)
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

    from inflight.runtime.logs import dump_stacks_on_signal
    from inflight.runtime.server import event_loop
    from inflight.runtime.server.serve import serve

    dump_stacks_on_signal()
    source: Any = load if core is None else core
    try:
        return event_loop.run(serve(settings, source, args.host, args.port, access_log_from_args(args),
                                    ready_checks=ready_checks, own_process=True), settings.event_loop)
    finally:
        if core is not None:
            core.kill()  # a server that stopped before its engine started leaves no waiting core


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def _json_errors(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for JSON logs (read before parsing, so usage errors are JSON too)."""
    args = list(argv)
    return any(a == "--log-format=json" or (a == "--log-format" and args[i + 1:i + 2] == ["json"])
               for i, a in enumerate(args))


def main(argv: Sequence[str] | None = None) -> int:
    argv = cli_vllm.normalize_argv(sys.argv[1:] if argv is None else argv)
    parser = build_parser(json_errors=_json_errors(argv))
    args, extras = parser.parse_known_args(argv)
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
    # the memory fraction sizes a GPU's KV cache only: on the CPU, say what does once the device is known
    ready_checks = [preflight.cpu_memory_fraction_note] if preflight.memory_fraction_given(list(argv)) else []
    try:
        return _serve(args, serve_parser, notices, ready_checks)
    except KeyboardInterrupt:  # Ctrl-C before the server runs (while converting or checking)
        print("inflight serve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
