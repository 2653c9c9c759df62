"""A burst of new connections waits in the kernel's accept queue, not for SYN retries: the
server listens with a backlog of ``--max-connections`` (at least 1024; aiohttp's default is
128), one front end or several, and says at start when ``net.core.somaxconn`` caps it."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import time
from pathlib import Path

import pytest

from inflight.runtime.server.front_ends import LISTEN_BACKLOG, backlog_capped_note, listen_backlog
from tests.server.server_helpers import ServeProcess, http

BURST = 400  # over aiohttp's default backlog of 128, under ours
CONNECT_PATIENCE_S = 30.0  # each connect completes in the kernel at once, or never while the server is stopped


def test_backlog_follows_max_connections() -> None:
    assert listen_backlog(10) == LISTEN_BACKLOG
    assert listen_backlog(4096) == 4096


def test_a_kernel_cap_below_the_backlog_is_said(tmp_path: Path) -> None:
    cap = tmp_path / "somaxconn"
    cap.write_text("128\n")
    note = backlog_capped_note(1024, str(cap))
    assert note is not None and "128" in note and "net.core.somaxconn" in note and "1024" in note
    cap.write_text("4096\n")
    assert backlog_capped_note(1024, str(cap)) is None
    assert backlog_capped_note(1024, str(tmp_path / "absent")) is None


def _connect_all(port: int, count: int, patience_s: float) -> tuple[list[socket.socket], int]:
    """``count`` non-blocking connects to ``port``: the sockets, and how many completed (the
    kernel finished the handshake: the connection sits in the accept queue) within ``patience_s``."""
    socks, pending = [], selectors.DefaultSelector()
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", port))
        socks.append(sock)
        pending.register(sock, selectors.EVENT_WRITE)
    connected, deadline = 0, time.monotonic() + patience_s
    while pending.get_map() and time.monotonic() < deadline:
        for key, _ in pending.select(timeout=0.5):
            pending.unregister(key.fileobj)
            if key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                connected += 1
    pending.close()
    return socks, connected


@pytest.mark.parametrize("front_ends", [1, 2])
def test_a_burst_of_connections_to_a_stopped_server_all_complete(demo_model_dir: Path, front_ends: int) -> None:
    """With the front end(s) stopped (SIGSTOP: nothing accepts), every connection of a burst of
    400 still completes its handshake into the accept queue; with a backlog of 128 the rest
    would have their SYNs dropped and wait for retries. Continued, the server serves them."""
    server = ServeProcess(["--model", str(demo_model_dir), "--served-model-name", "demo", "--host", "127.0.0.1",
                           "--port", "0", "--api-server-count", str(front_ends), "--max-num-sequences", "4"])
    try:
        server.wait_ready()
        front = [pid for pid in server.server_pids()
                 if pid == server.proc.pid or Path(f"/proc/{pid}/comm").read_text().startswith("inflight-api")]
        assert len(front) == front_ends, server.log()
        socks: list[socket.socket] = []
        try:
            for pid in front:
                os.kill(pid, signal.SIGSTOP)
            socks, connected = _connect_all(server.port, BURST, CONNECT_PATIENCE_S)
            assert connected == BURST, f"{connected} of {BURST} connections completed while nothing accepted"
        finally:
            for pid in front:
                os.kill(pid, signal.SIGCONT)
            for sock in socks:
                sock.close()
        body = {"model": "demo", "prompt": "hi", "max_tokens": 2}
        assert http("POST", f"{server.url}/v1/completions", body).json()["usage"]["completion_tokens"] == 2
    finally:
        server.stop()
