"""The front end's event loop: uvloop where it is installed (``--event-loop``).

Every front-end process (the one the CLI starts and each one ``--api-server-count`` spawns)
runs its HTTP server, SSE streams and engine-core pipe reader on one asyncio event loop. On a
busy server that loop's own overhead is a share of every streamed token: a task wakeup, a
socket write and a callback per stream per step. uvloop (libuv under the asyncio API, what
vLLM's and SGLang's API servers run on) does those in C. Choices:

- ``auto`` (the default): uvloop when it can be imported (it is a serving dependency on
  Linux and macOS), else asyncio's own loop; the start-up log names the one chosen.
- ``uvloop``: uvloop, or an error at start when it is not installed.
- ``asyncio``: the standard library's loop (to rule the loop out when debugging).

The engine core never runs an event loop; this module knows nothing about HTTP or the engine.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

logger = logging.getLogger("inflight.server")

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


class EventLoopUnavailableError(RuntimeError):
    """``--event-loop uvloop`` on a machine without uvloop."""


def loop_factory(choice: str) -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """(the loop's name as the log shows it, its factory; ``None`` for asyncio's default)."""
    if choice not in EVENT_LOOPS:
        raise ValueError(f"event loop {choice!r}: choose one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return "asyncio", None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError as exc:
        if choice == "uvloop":
            raise EventLoopUnavailableError(
                "--event-loop uvloop: uvloop is not installed (pip install uvloop), or use --event-loop asyncio"
            ) from exc
        return "asyncio (uvloop is not installed)", None
    return f"uvloop {uvloop.__version__}", uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """Run ``main`` to completion on the chosen loop, as :func:`asyncio.run` does (which it is
    for ``asyncio``), and log which loop serves."""
    try:
        name, factory = loop_factory(choice)
    except BaseException:
        main.close()  # never awaited: no "coroutine was never awaited" warning on top of the error
        raise
    logger.info("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
