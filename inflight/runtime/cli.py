"""The ``inflight`` command line: ``inflight serve --model DIR ...``.

Owns the argument parser. Engine flags are generated from ``EngineConfig``'s fields (name
with dashes, the field's help text, the dataclass default; bools as ``--x/--no-x``), so a
new engine knob becomes a flag with no edit here and no second copy of a default. Server
flags (--model, --host, --port, ...) are the only hand-written ones. Knows nothing about
HTTP handling: it builds ``EngineConfig`` and ``ServerSettings`` and calls ``serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

from inflight.runtime.config import EngineConfig
from inflight.runtime.server.state import ServerSettings

API_KEY_ENV = "INFLIGHT_API_KEY"
LOG_LEVELS = ("debug", "info", "warning", "error")

logger = logging.getLogger("inflight.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description="In-flight batching LLM server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve a model over the OpenAI HTTP API",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    server = serve.add_argument_group("server")
    server.add_argument("--model", required=True, help="Local Hugging Face model directory.")
    server.add_argument("--host", default="127.0.0.1", help="Address to bind.")
    server.add_argument("--port", type=int, default=8000, help="Port to bind (0: any free port).")
    server.add_argument("--served-model-name", default=None,
                        help="Model name clients send (default: the --model argument).")
    server.add_argument("--api-key", default=None,
                        help=f"Require 'Authorization: Bearer KEY' on /v1 and /admin (env {API_KEY_ENV}).")
    server.add_argument("--drain-timeout", type=float, default=30.0,
                        help="Seconds to let requests in flight finish after SIGTERM.")
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="Log level.")
    add_engine_flags(serve.add_argument_group("engine"))
    return parser


def add_engine_flags(group: argparse._ArgumentGroup) -> None:
    """One flag per ``EngineConfig`` field, typed from its annotation."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        kind, optional = _flag_type(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else argparse.SUPPRESS
        help_text = f.metadata.get("help", "")
        if optional and kind is not int:
            raise TypeError(f"EngineConfig.{f.name}: only Optional[int] fields have a flag form")
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=help_text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=default, help=help_text,
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
        drain_timeout_s=args.drain_timeout,
    )


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from inflight.runtime.server.logs import configure_logging
    from inflight.runtime.server.serve import serve

    try:
        config = engine_config_from_args(args)
        settings = server_settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not os.path.isdir(args.model):
        parser.error(f"--model {args.model}: no such directory (make one with "
                     "`python -m inflight.runtime.demo_model models/demo`)")
    configure_logging(args.log_level)
    model_dir = args.model

    def load() -> Any:
        from inflight.runtime.engine import LLMEngine

        progress = logging.getLogger("inflight.loading")
        progress.info("loading %s with %s", model_dir, config.to_dict())
        return LLMEngine.from_model_dir(model_dir, config, progress=progress.info)

    return asyncio.run(serve(settings, load, args.host, args.port))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(args, parser)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
