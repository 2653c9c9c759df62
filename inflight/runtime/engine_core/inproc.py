"""The engine core on a thread of this process, behind an in-memory channel (vLLM's ``InprocClient``).

``--single-process`` and most server tests run the engine here. :class:`InprocCore` runs the
same :class:`~.core.EngineCore` loop as the engine-core process, on a thread, and the front end
talks to it in the same :mod:`.protocol` messages over a :class:`Channel` instead of a pipe: the
objects are handed over as they are (nothing is pickled), and the step clock is a plain
attribute instead of a shared double. So the two modes differ only in where the loop runs. The
thread loads the engine (``loader``), warms it up, sends :class:`~.protocol.Ready` (or
:class:`~.protocol.LoadFailed`), then runs the loop until :class:`~.protocol.Shutdown`, the
front end's end closing, or its death (:class:`~.protocol.Dead` first). Knows nothing about HTTP
or the event loop.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from inflight.runtime.engine_core import protocol as p
from inflight.runtime.engine_core.core import EngineCore, load_failure

logger = logging.getLogger("inflight.engine_core")

_CLOSED = object()  # the end-of-channel mark: what a closed pipe's EOF is to a Connection


class Channel:
    """One end of an in-memory duplex channel, with the ``Connection`` methods the loop and the
    client use. One thread reads an end (``poll``/``recv``); any thread may send or close.
    After either end closes, ``recv`` raises ``EOFError`` once what was sent before is read,
    ``poll`` answers True (as a pipe at EOF does), and ``send`` raises ``OSError``."""

    def __init__(self, inbox: queue.SimpleQueue[Any], outbox: queue.SimpleQueue[Any]) -> None:
        self._inbox = inbox
        self._outbox = outbox
        self._next: Any = None  # a message poll() took off the queue, for recv()
        self._has_next = False
        self.peer: Channel | None = None
        self.closed = False

    def send(self, obj: Any) -> None:
        if self.closed or (self.peer is not None and self.peer.closed):
            raise OSError("the channel is closed")
        self._outbox.put(obj)

    def poll(self, timeout: float | None = 0.0) -> bool:
        if self._has_next:
            return True
        try:
            if timeout is None:
                self._next = self._inbox.get()
            elif timeout > 0:
                self._next = self._inbox.get(timeout=timeout)
            else:
                self._next = self._inbox.get_nowait()
        except queue.Empty:
            return False
        self._has_next = True
        return True

    def recv(self) -> Any:
        message = self._next if self._has_next else self._inbox.get()
        if message is _CLOSED:  # kept: every later read sees the end too
            self._next, self._has_next = _CLOSED, True
            raise EOFError("the channel is closed")
        self._next, self._has_next = None, False
        return message

    def close(self) -> None:
        """Close both directions: the peer's reader, and this end's own, see the end."""
        if not self.closed:
            self.closed = True
            self._outbox.put(_CLOSED)
            self._inbox.put(_CLOSED)


def duplex() -> tuple[Channel, Channel]:
    """Two connected ends: what one sends, the other receives, in order."""
    a_to_b: queue.SimpleQueue[Any] = queue.SimpleQueue()
    b_to_a: queue.SimpleQueue[Any] = queue.SimpleQueue()
    a, b = Channel(b_to_a, a_to_b), Channel(a_to_b, b_to_a)
    a.peer, b.peer = b, a
    return a, b


class ThreadStepClock:
    """The step clock of a loop on a thread (a shared double's ``value``, in-process)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0


class InprocCore:
    """The engine core on a thread, and the front end's end of its channel (``conn``).

    ``loader`` builds the engine (``() -> LLMEngine``, not warmed up, as
    :func:`~.core.load_engine` does; it sends token ids only: the front end makes the text).
    ``core`` is the running loop once loaded (None before, or when loading failed).
    """

    def __init__(self, loader: Callable[[], Any]) -> None:
        self.conn, self._core_conn = duplex()
        self.step_clock = ThreadStepClock()
        self.core: EngineCore | None = None
        self._loader = loader
        self.thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        """Close the front end's end: a loop still turning sees it and ends."""
        self.conn.close()

    def _run(self) -> None:
        conn = self._core_conn
        try:
            engine = self._loader()
            engine.warmup()
        except BaseException as exc:  # noqa: BLE001 - reported to the front end as LoadFailed
            _send_quietly(conn, p.LoadFailed(load_failure(exc)))
            conn.close()
            return
        core = EngineCore(engine, conn, self.step_clock)
        self.core = core
        _send_quietly(conn, p.Ready(p.PROTOCOL_VERSION, engine.summary(), engine.stats()))
        core.serve("the engine thread")
        conn.close()


def _send_quietly(conn: Channel, message: object) -> None:
    try:
        conn.send(message)
    except OSError:
        pass
