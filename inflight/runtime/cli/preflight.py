"""What ``inflight serve`` checks before anything heavy, each problem one line: the host and port
(range, resolution, in use), the model directory (a GGUF file converted once; an overlay for
``--tokenizer`` / ``--chat-template``), its tokenizer and template, ``--max-model-len`` against
the model's, a draft model against it (``draft_checks``; these read by the engine-core
process, see ``served_facts``), and a KV cache smaller than one full-length sequence (also
after the engine loads, in the engine-core process). Knows nothing about argparse beyond
reading ``args``.
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from inflight import env_vars
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.input_checks import kv_cache_problem
from inflight.runtime.engine_core.served_facts import ServedFacts, load_checked_tokenizer, read_served_facts

MAX_PORT = 65535
logger = logging.getLogger("inflight.cli")
# The flags that set the GPU's KV-cache share (vLLM's two spellings, then ours).
MEMORY_FRACTION_FLAGS = ("--gpu-memory-utilization", "--device-memory-utilization",
                         "--kv-cache-free-gpu-mem-fraction")
MAKE_RUN_ENV = "INFLIGHT_MAKE_RUN"  # set by `make run`: errors name its variables (PORT=) over flags


def host_problem(host: str) -> str | None:
    """Why ``--host`` cannot be bound because it names no address (one line), or ``None``."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        return f"--host {host}: cannot resolve it ({reason})"
    return None


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound right now (one line), or ``None`` when it can."""
    if not 0 <= port <= MAX_PORT:
        return f"--port {port}: not a port (use 1..{MAX_PORT}, or 0 for any free port)"
    problem = host_problem(host)
    if problem or port == 0:
        return problem
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                how = (f"PORT= on the make command line (e.g. PORT={port + 1 if port < MAX_PORT else 8000})"
                       if env_vars.read_bool(MAKE_RUN_ENV) else "--port")
                return f"port {port} on {host} is already in use (another server?); choose another with {how}"
            return f"cannot bind {host}:{port}: {exc.strerror}"
    return None


def memory_fraction_given(argv: list[str]) -> bool:
    """Whether ``argv`` sets the GPU's KV-cache share (:data:`MEMORY_FRACTION_FLAGS`)."""
    return any(arg.split("=", 1)[0] in MEMORY_FRACTION_FLAGS for arg in argv)


def cpu_memory_fraction_note(engine: Any) -> str | None:
    """For a loaded engine on the CPU: that the memory fraction it was given does nothing there,
    and what sizes its KV cache instead (``None`` on any other device)."""
    if engine.resolved.get("device") != "cpu":
        return None
    config = engine.config
    return (f"--gpu-memory-utilization / --kv-cache-free-gpu-mem-fraction "
            f"{config.kv_cache_free_gpu_mem_fraction:g} has no effect on the CPU (it is the share of free GPU "
            f"memory given to the KV cache). On the CPU --num-kv-blocks sizes it (this server: "
            f"{config.num_kv_blocks} blocks of {config.block_size} tokens); unset, it holds --max-num-sequences "
            "full-length sequences within a fixed byte cap, and --max-tokens-in-paged-kv-cache caps it in tokens.")


def served_dir(args: argparse.Namespace, progress: Callable[[str], None]) -> Path:
    """The directory to serve: a GGUF file converted once; an overlay for --tokenizer or
    --chat-template. Reads no weights and imports no torch, unless converting."""
    from inflight.runtime import chat_templates
    from inflight.runtime.cli.serving_dir import read_chat_template, serving_dir
    from inflight.runtime.model.gguf_source import resolve_model_dir

    model_dir = resolve_model_dir(args.model, progress)
    template = read_chat_template(chat_templates.resolve(args.chat_template)) if args.chat_template is not None else None
    tokenizer_dir = Path(args.tokenizer) if args.tokenizer is not None else None
    served = serving_dir(model_dir, tokenizer_dir, template)
    if served != model_dir:
        progress(f"serving {model_dir} with the tokenizer of {tokenizer_dir or model_dir}"
                 f"{' and the given chat template' if template is not None else ''} (overlay {served})")
    return served


def check_served(args: argparse.Namespace, config: EngineConfig, served: Path,
                 facts: ServedFacts | None = None) -> Any:
    """The served directory's tokenizer, template, architecture, --max-model-len, draft model
    and, when the block count is explicit, the KV cache size, checked before any weight loads
    (``ValueError``); returns the tokenizer it loaded. ``facts``: what the engine-core process
    read of the model (``served_facts``); without them they are read here, importing torch."""
    from inflight.runtime.server.openai.tool_calls import renders_tools  # the engine core imports this module

    if facts is None:
        facts, tokenizer = read_served_facts(served, config)
    else:
        tokenizer = load_checked_tokenizer(served, facts.tokenizer_class)
    if args.chat_template is not None:
        check_template(tokenizer)
    if (args.enable_auto_tool_choice or args.tool_call_parser) and not renders_tools(tokenizer.chat_template):
        logger.warning("the chat template does not render tools: tool_choice 'auto' requests will be refused "
                       "(400); give one that does with --chat-template (SmolLM2: --chat-template smollm2-tools)")
    limit = facts.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"--max-model-len {config.max_model_len} is longer than the model supports ({limit}, "
                         f"its max_position_embeddings in {(served / 'config.json').resolve()}); lower it or leave it unset")
    if config.num_kv_blocks is not None:
        known = SimpleNamespace(config=config, max_model_len=config.max_model_len or limit)
        refusal = kv_cache_problem(known)
        if refusal:
            raise ValueError(refusal)
    return tokenizer


def check_template(tokenizer: Any) -> None:
    """A given chat template must render a plain conversation (``ValueError``)."""
    from jinja2 import TemplateError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:
        raise ValueError(f"--chat-template: the template does not render: {exc}") from exc
    except Exception:  # noqa: BLE001 - the template's own checks on these messages; requests will tell
        pass
