"""The engine core's front ends: one connection each, and which front end owns which request.

``inflight serve --api-server-count N`` runs N front-end processes over one engine core (vLLM's
API-server processes); each has a connection of its own. :class:`FrontEnds` holds them, waits on
all of them at once when the loop is idle (:func:`multiprocessing.connection.wait`), remembers
which front end added each request, and splits a step's outputs so that each front end gets
only its own requests' (a finished or aborted request is forgotten). A front end whose
connection closes, or that sent :class:`~.protocol.Shutdown`, is gone: the loop aborts the
requests it owned and goes on for the others; when the last one is gone the loop ends.

One connection (the default, ``--single-process``, and the in-memory :class:`~.inproc.Channel`)
is the plain case: nothing is tracked, every output goes to it. Several must be
``multiprocessing`` connections (waitable). Knows nothing about the engine, HTTP or processes.
"""

from __future__ import annotations

import multiprocessing.connection
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from inflight.runtime.outputs import RequestOutput


class Conn(Protocol):
    """What the loop uses of a connection: a ``multiprocessing`` pipe end, or
    :class:`~.inproc.Channel` on a thread."""

    def send(self, obj: Any) -> None: ...

    def recv(self) -> Any: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...

    def close(self) -> None: ...


class FrontEnds:
    """The core's connections, by front-end index (0 is the one that started the core)."""

    def __init__(self, conns: Sequence[Conn]) -> None:
        if not conns:
            raise ValueError("an engine core needs at least one front-end connection")
        self.conns: dict[int, Conn] = dict(enumerate(conns))
        self.routed = len(conns) > 1
        self._owner: dict[str, int] = {}  # req_id -> front-end index (routed only)

    @classmethod
    def of(cls, conns: Conn | Sequence[Conn] | FrontEnds) -> FrontEnds:
        """``conns`` as front ends: one connection, a list or tuple of them, or front ends already."""
        if isinstance(conns, FrontEnds):
            return conns
        return cls(list(conns) if isinstance(conns, (list, tuple)) else [conns])  # type: ignore[list-item]

    @property
    def first(self) -> Conn:
        """Front end 0's connection (the start-up handshake: Prewarmed, Go)."""
        return self.conns[0]

    @property
    def is_empty(self) -> bool:
        return not self.conns

    def wait(self, timeout: float) -> None:
        """Block until a message is waiting on any connection, or ``timeout`` seconds pass."""
        if not self.routed:
            for conn in self.conns.values():
                conn.poll(timeout)
            return
        if self.conns:
            multiprocessing.connection.wait(list(self.conns.values()), timeout)  # type: ignore[arg-type]

    def waiting(self) -> Iterator[tuple[int, Conn]]:
        """Each open connection with a message waiting (a snapshot: one may close meanwhile)."""
        for index, conn in list(self.conns.items()):
            if index in self.conns and conn.poll(0):
                yield index, conn

    def send(self, index: int, message: object) -> None:
        """To one front end; one that is gone gets nothing."""
        conn = self.conns.get(index)
        if conn is not None:
            self._send(index, conn, message)

    def broadcast(self, message: object, but: int | None = None) -> None:
        """Send ``message`` to every front end (``but`` that one)."""
        for index, conn in list(self.conns.items()):
            if index != but:
                self._send(index, conn, message)

    def _send(self, index: int, conn: Conn, message: object) -> None:
        try:
            conn.send(message)
        except (OSError, ValueError):
            if not self.routed:
                raise  # the one front end is gone: the loop ends (as it always has)
            # gone: its requests stay owned by it until the loop takes them (orphans) to abort
            self._forget_conn(index)

    def close(self, index: int) -> tuple[str, ...]:
        """Front end ``index`` is gone: forget it; the requests it owned, to abort."""
        self._forget_conn(index)
        orphans = tuple(r for r, owner in self._owner.items() if owner == index)
        for req_id in orphans:
            del self._owner[req_id]
        return orphans

    def _forget_conn(self, index: int) -> None:
        # Not closed here: a front end that sent Shutdown may still read what came before it;
        # the process's exit (or the thread's owner) closes it.
        self.conns.pop(index, None)

    def orphans(self) -> tuple[str, ...]:
        """Requests whose front end is gone (closed on a failed send), forgotten now: to abort."""
        gone = tuple(r for r, owner in self._owner.items() if owner not in self.conns)
        for req_id in gone:
            del self._owner[req_id]
        return gone

    def own(self, index: int, req_ids: Sequence[str]) -> None:
        if self.routed:
            for req_id in req_ids:
                self._owner[req_id] = index

    def forget(self, req_ids: Sequence[str]) -> None:
        if self.routed:
            for req_id in req_ids:
                self._owner.pop(req_id, None)

    def num_owned(self) -> int:
        return len(self._owner)

    def split(self, outputs: Sequence[RequestOutput]) -> dict[int, list[RequestOutput]]:
        """Each open front end's share of one step's outputs (every one gets a list, maybe empty:
        the step's stats go to all). Finished requests are forgotten; an output whose front end
        is gone is dropped."""
        if not self.routed:
            return {index: list(outputs) for index in self.conns}
        shares: dict[int, list[RequestOutput]] = {index: [] for index in self.conns}
        for out in outputs:
            owner = self._owner.pop(out.req_id, None) if out.finished else self._owner.get(out.req_id)
            share = shares.get(owner) if owner is not None else None
            if share is not None:
                share.append(out)
        return shares
