"""The ``inflight`` command line: ``inflight serve --model DIR ...``.

Owns the argument parser. Engine flags are generated from ``EngineConfig``'s fields (name
with dashes, the field's help text, the dataclass default; bools as ``--x/--no-x``), so a
new engine knob becomes a flag with no edit here and no second copy of a default. Server
flags (--model, --host, --port, ...) are the only hand-written ones; vLLM's spellings of the
same knobs are accepted as aliases (``VLLM_ALIASES``). Before anything heavy it checks what a
user gets wrong on day one, each reported in one line: a bad value (with ``serve``'s usage), a
model path that is not a model, a port in use, a tokenizer that does not load. A ``.gguf``
model is converted once into a cached directory (``gguf_source``). Knows nothing about HTTP
handling: it builds ``EngineConfig`` and ``ServerSettings`` and calls ``serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import logging
import os
import socket
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from inflight import __version__
from inflight.runtime.config import EngineConfig
from inflight.runtime.server.state import ServerSettings

API_KEY_ENV = "INFLIGHT_API_KEY"
ADMIN_API_KEY_ENV = "INFLIGHT_ADMIN_API_KEY"
SINGLE_PROCESS_ENV = "INFLIGHT_SINGLE_PROCESS"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")
# vLLM's flag names for EngineConfig fields, accepted as aliases (docs/from-vllm.md).
VLLM_ALIASES = {
    "max_num_sequences": ("--max-num-seqs",),
    "max_num_tokens": ("--max-num-batched-tokens",),
    "kv_cache_free_gpu_mem_fraction": ("--gpu-memory-utilization",),
}

logger = logging.getLogger("inflight.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description="In-flight batching LLM server.")
    parser.add_argument("--version", action="version", version=f"inflight {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI HTTP API",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    server = serve.add_argument_group("server")
    server.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="Same as --model (vLLM's positional form).")
    server.add_argument("--model", default=None,
                        help="Local Hugging Face model directory, or a .gguf file (converted once "
                             "into a cache directory).")
    server.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    server.add_argument("--port", type=int, default=8000, help="Port to bind (0: any free port).")
    server.add_argument("--served-model-name", default=None,
                        help="Model name clients send (default: the --model argument).")
    server.add_argument("--api-key", default=None,
                        help=f"Require 'Authorization: Bearer KEY' on /v1 (env {API_KEY_ENV}).")
    server.add_argument("--admin-api-key", default=None,
                        help=f"Enable /admin, with 'Authorization: Bearer KEY' (env {ADMIN_API_KEY_ENV}); "
                             "/admin is off without it and --api-key never grants it.")
    server.add_argument("--engine-stall-timeout", type=float, default=_server_default("engine_stall_timeout_s"),
                        help="Seconds one engine step may run before the server declares the engine dead, "
                             "answers every client with 503 and exits non-zero.")
    server.add_argument("--keepalive-timeout", type=float, default=_server_default("keepalive_timeout_s"),
                        help="Seconds before an idle connection, or one that has not sent a whole "
                             "request head, is closed.")
    server.add_argument("--request-read-timeout", type=float, default=_server_default("request_read_timeout_s"),
                        help="Seconds a request body may take to arrive (408 after).")
    server.add_argument("--stream-write-timeout", type=float, default=_server_default("stream_write_timeout_s"),
                        help="Seconds a stream may wait for its client to read before it is cut "
                             "and its requests aborted.")
    server.add_argument("--drain-timeout", type=float, default=30.0,
                        help="Seconds to let requests in flight finish after SIGTERM.")
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="Log level.")
    server.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="text: one readable line per event; json: one JSON object per line.")
    server.add_argument("--single-process", action="store_true",
                        default=os.environ.get(SINGLE_PROCESS_ENV, "") not in ("", "0"),
                        help="Run the engine in a thread of the server process instead of an engine-core "
                             f"process of its own (for debugging; env {SINGLE_PROCESS_ENV}=1).")
    add_engine_flags(serve.add_argument_group("engine"))
    return parser


def _server_default(name: str) -> Any:
    """The ``ServerSettings`` default of ``name`` (the one copy of it)."""
    return next(f.default for f in dataclasses.fields(ServerSettings) if f.name == name)


def add_engine_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per ``EngineConfig`` field, typed from its annotation."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind, optional = _flag_type(hints[f.name])
        flags = ("--" + f.name.replace("_", "-"), *VLLM_ALIASES.get(f.name, ()))
        default = f.default if f.default is not dataclasses.MISSING else argparse.SUPPRESS
        help_text = f.metadata.get("help", "")
        if optional and kind not in (int, str):
            raise TypeError(f"EngineConfig.{f.name}: only Optional[int] and Optional[str] fields have a flag form")
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, type=kind, default=default, help=help_text,
                               metavar="N" if kind in (int, float) else "VALUE")


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
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        admin_api_key=args.admin_api_key or os.environ.get(ADMIN_API_KEY_ENV) or None,
        drain_timeout_s=args.drain_timeout,
        engine_stall_timeout_s=args.engine_stall_timeout,
        keepalive_timeout_s=args.keepalive_timeout,
        request_read_timeout_s=args.request_read_timeout,
        stream_write_timeout_s=args.stream_write_timeout,
    )


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound right now (one line), or ``None`` when it can."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        return f"--host {host}: cannot resolve it ({exc.strerror})"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use (another server?); choose another with --port"
            return f"cannot bind {host}:{port}: {exc.strerror}"
    return None


def kv_cache_problem(engine: Any) -> str | None:
    """vLLM's start-up refusal: the KV cache must hold at least one full-length sequence."""
    capacity = engine.config.num_kv_blocks * engine.config.block_size
    if capacity >= engine.max_model_len:
        return None
    return (f"the KV cache holds {capacity} tokens, fewer than one full-length sequence "
            f"(max_model_len {engine.max_model_len}); raise --num-kv-blocks (on CUDA: "
            "--kv-cache-free-gpu-mem-fraction) or lower --max-model-len")


def _prepare_model(model: str, config: EngineConfig, progress: Callable[[str], None]) -> Path:
    """The model directory (a GGUF file converted once), with its tokenizer and, when the block
    count is explicit, the KV cache size checked before any weight loads."""
    from inflight.runtime.model.gguf_source import resolve_model_dir
    from inflight.runtime.model.loader import load_hf_config
    from inflight.runtime.tokenizer import load_tokenizer

    model_dir = resolve_model_dir(model, progress)
    try:
        load_tokenizer(model_dir)
    except Exception as exc:  # transformers raises many kinds; all mean the same to the user
        raise ValueError(f"the tokenizer in {model_dir} does not load: {exc}") from exc
    if config.num_kv_blocks is not None:
        max_len = config.max_model_len or load_hf_config(model_dir).max_position_embeddings
        known = SimpleNamespace(config=config, max_model_len=max_len)
        refusal = kv_cache_problem(known)
        if refusal:
            raise ValueError(refusal)
    return model_dir


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from inflight.runtime.model.gguf_source import model_dir_problem
    from inflight.runtime.server.logs import configure_logging
    from inflight.runtime.server.serve import serve
    from inflight.runtime.stats_log import start_stats_log

    try:
        config = engine_config_from_args(args)
        settings = server_settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    problem = model_dir_problem(args.model)
    if problem:
        parser.error(problem)
    in_use = port_problem(args.host, args.port)
    if in_use:
        print(f"inflight serve: error: {in_use}", file=sys.stderr)
        return 1
    configure_logging(args.log_level, args.log_format)
    progress = logging.getLogger("inflight.loading")
    try:
        model_dir = _prepare_model(args.model, config, progress.info)
    except ValueError as exc:
        print(f"inflight serve: error: {exc}", file=sys.stderr)
        return 1

    def load() -> Any:
        from inflight.runtime.engine import LLMEngine

        progress.info("loading %s with %s", model_dir, config.to_dict())
        engine = LLMEngine.from_model_dir(model_dir, config, progress=progress.info)
        refusal = kv_cache_problem(engine)
        if refusal:
            raise ValueError(refusal)
        start_stats_log(engine.stats)
        return engine

    source: Any = load
    if not args.single_process:
        from inflight.runtime.engine_core.core import CoreLaunch

        source = CoreLaunch(str(model_dir), config, args.log_level, args.log_format)
    return asyncio.run(serve(settings, source, args.host, args.port))


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve_parser = _serve_parser(parser)
        if args.model and args.model_path and args.model != args.model_path:
            serve_parser.error(f"two models given: {args.model_path} and --model {args.model}")
        args.model = args.model or args.model_path
        if not args.model:
            serve_parser.error("the model is required: inflight serve MODEL (or --model MODEL)")
        return _serve(args, serve_parser)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
