"""Several front-end processes on one engine core (``--api-server-count N``, vLLM's API servers).

Owns the processes, not what they serve. Front end 0 is the server's own process: it binds the
port (:func:`bind_listeners`; a conflict, and the port 0 chose, are reported once, there), starts
the engine core with one pipe per front end (:class:`~.engine_process.CoreProcess`) and spawns
front ends 1..N-1 (:class:`FrontEndGroup`), each running the same app
(:func:`~.serve.serve`) over its own pipe (:class:`~.engine_process.CoreLink`). Each front end
listens on a socket of its own bound to the same address with ``SO_REUSEPORT``, so the kernel
spreads new connections evenly over them (one shared listening socket would let whichever
process wakes first accept a whole burst).

Supervision, the simplest honest policy: the front ends are one server. A front end that exits
while the server is not stopping takes the server down (front end 0 declares its engine dead,
which answers every stream, kills the core, and every other front end then answers its own and
exits 1), so the orchestrator restarts the pod. A signal to front end 0 drains every front end
(it forwards ``SIGTERM``); front ends 1..N-1 ignore ``SIGINT`` and ``SIGHUP`` (front end 0
decides) and die with it (``PR_SET_PDEATHSIG``). Request metrics are shared through
prometheus_client's multiprocess files (:mod:`.metrics`). Knows nothing about request handling.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from inflight.runtime.engine_core.process_setup import die_with_parent, name_process
from inflight.runtime.logs import AccessLog, configure_logging, dump_stacks_on_signal
from inflight.runtime.server.engine_process import CoreLink, CoreProcess
from inflight.runtime.server.metrics import enable_multiprocess
from inflight.runtime.server.state import ServerSettings

logger = logging.getLogger("inflight.server")

LISTEN_BACKLOG = 1024  # the least listen backlog: --max-connections' default
SOMAXCONN = "/proc/sys/net/core/somaxconn"
WATCH_INTERVAL_S = 0.2  # how often front end 0 looks for a front end that exited

Address = tuple[int, tuple]  # (address family, socket address)


def listen_backlog(max_connections: int) -> int:
    """The listen backlog for a server that takes ``max_connections`` at once: a burst of that
    many new connections waits in the kernel's accept queue, not for SYN retries (aiohttp's
    default of 128 dropped the rest of a 512-connection burst, which then waited 1 s and more)."""
    return max(LISTEN_BACKLOG, max_connections)


def backlog_capped_note(backlog: int, somaxconn_path: str = SOMAXCONN) -> str | None:
    """A warning when the kernel caps the listen backlog below ``backlog`` (``net.core.somaxconn``);
    None when it does not, or where it cannot be read."""
    try:
        with open(somaxconn_path) as f:
            cap = int(f.read().strip())
    except (OSError, ValueError):
        return None
    if cap >= backlog:
        return None
    return (f"the kernel caps the listen backlog at {cap} (net.core.somaxconn), below the {backlog} asked for: "
            f"a burst of more than {cap} new connections waits for SYN retries (1 s and more); raise the sysctl "
            "(a pod's securityContext.sysctls) to serve such bursts without that wait")


def bind_listeners(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> list[socket.socket]:
    """Listening sockets on every address ``host`` resolves to, ``SO_REUSEPORT`` set (so that the
    other front ends can bind the same address); port 0 picks one free port for all."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen: set[tuple] = set()
    for family, _, _, _, address in infos:
        if address in seen:
            continue
        seen.add(address)
        if port == 0 and sockets:  # the rest on the port the first was given
            address = (address[0], sockets[0].getsockname()[1], *address[2:])
        try:
            address = _claim(family, address)
            sockets.append(listen(family, address, backlog))
        except OSError:
            for sock in sockets:
                sock.close()
            raise
    return sockets


def _claim(family: int, address: tuple) -> tuple:
    """Bind ``address`` once without ``SO_REUSEPORT`` and let go: ``OSError`` (address in use)
    when anything listens there already, even another server that shares its port, which a
    ``SO_REUSEPORT`` bind alone would join silently. The address bound (port 0 resolved)."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        probe.bind(address)
        return probe.getsockname()[:2] + tuple(address[2:])


def listen(family: int, address: tuple, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """One non-blocking listening socket on ``address``, sharing it (``SO_REUSEPORT``)."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def addresses_of(sockets: list[socket.socket]) -> list[Address]:
    return [(sock.family, sock.getsockname()) for sock in sockets]


@dataclass(frozen=True)
class FrontEndLaunch:
    """What a spawned front end needs (picklable while spawning: the link carries descriptors)."""

    settings: ServerSettings
    link: CoreLink
    addresses: list[Address]
    access_log: AccessLog
    log_level: str
    log_format: str
    metrics_dir: str
    ready: Any  # a multiprocessing Event: set once this front end serves (front end 0's /ready waits for it)


@dataclass(frozen=True)
class Spawned:
    """A spawned front end's part in :func:`~.serve.serve`: its sockets, and what to call once ready."""

    sockets: list[socket.socket]
    on_ready: Callable[[], None]


def start_front_end(launch: FrontEndLaunch) -> Spawned:
    """In a spawned front end, before it serves (:func:`~.serve.run_front_end`): die with front
    end 0, leave SIGINT and SIGHUP to it, log as it does, share its metrics, bind the sockets."""
    die_with_parent()
    name_process(f"inflight-api-{launch.link.index}".encode())
    dump_stacks_on_signal()
    for sig in (signal.SIGINT, signal.SIGHUP):  # front end 0 decides when to stop
        signal.signal(sig, signal.SIG_IGN)
    configure_logging(launch.log_level, launch.log_format)
    enable_multiprocess(launch.metrics_dir)
    backlog = listen_backlog(launch.settings.connection_limits.max_connections)
    sockets = [listen(family, address, backlog) for family, address in launch.addresses]
    logger.info("front end %d (pid %d) listening on the shared port; loading its tokenizer", launch.link.index,
                os.getpid())
    return Spawned(sockets, launch.ready.set)


def exit_front_end(code: int) -> None:
    """End a spawned front end with ``code``, its log flushed (nothing else to tear down)."""
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


class FrontEndGroup:
    """Front ends 1..N-1, as front end 0 sees them: spawned, watched, drained, killed."""

    def __init__(self, count: int) -> None:
        self.count = count  # front ends in all, this one included
        self.processes: list[BaseProcess] = []
        self.stopping = False
        self.metrics_dir: str | None = None
        self._ready: list[Any] = []

    def make_metrics_dir(self) -> None:
        """A private directory for the front ends' shared request metrics, made the one
        prometheus_client uses here (and, inherited, in the front ends spawned later)."""
        self.metrics_dir = tempfile.mkdtemp(prefix="inflight-metrics-")
        enable_multiprocess(self.metrics_dir)

    def remove_metrics_dir(self) -> None:
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = None

    def all_ready(self) -> bool:
        """Every spawned front end serves (front end 0's /ready says ready only then)."""
        return len(self._ready) == self.count - 1 and all(event.is_set() for event in self._ready)

    def spawn(self, core: CoreProcess, make: Callable[[CoreLink, Any], FrontEndLaunch],
              target: Callable[[FrontEndLaunch], None]) -> None:
        """Start front ends 1..count-1 on ``core`` (started), each running ``target(launch)``
        (:func:`~.serve.run_front_end`), then let go of their pipe ends."""
        ctx = multiprocessing.get_context("spawn")
        for index in range(1, self.count):
            ready = ctx.Event()
            process = ctx.Process(target=target, args=(make(core.link(index), ready),),
                                  name=f"inflight-api-{index}", daemon=False)  # fmt: skip
            process.start()
            self.processes.append(process)
            self._ready.append(ready)
        core.release_links()

    def terminate(self) -> None:
        """Drain them all (``SIGTERM``, once)."""
        if self.stopping:
            return
        self.stopping = True
        for process in self.processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)

    def kill(self) -> None:
        self.stopping = True
        for process in self.processes:
            if process.is_alive():
                process.kill()

    async def watch(self, on_exit: Callable[[str], None]) -> None:
        """Until one exits while the server is not stopping: then ``on_exit(why)`` (once)."""
        while not self.stopping:
            for index, process in enumerate(self.processes, start=1):
                if process.exitcode is not None and not self.stopping:
                    on_exit(f"front end {index} (pid {process.pid}) exited with code {process.exitcode}")
                    return
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def wait(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for all to exit (the rest are killed): 0 when every one
        exited 0, else 1."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for process in self.processes:
            await asyncio.to_thread(process.join, max(0.0, deadline - loop.time()))
        late = [p for p in self.processes if p.exitcode is None]
        for process in late:
            logger.error("front end %s (pid %s) did not exit in time; killing it", process.name, process.pid)
            process.kill()
            await asyncio.to_thread(process.join, 5.0)
        return 0 if all(p.exitcode == 0 for p in self.processes) else 1
