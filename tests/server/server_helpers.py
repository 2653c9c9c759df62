"""Test helpers: an in-process server on 127.0.0.1 (its own event loop thread), a real
``inflight serve`` subprocess, and small HTTP / metrics utilities. Every wait is bounded.

The one live-server harness of the test suite: the server, structured-output and hostile
tests all import it as ``tests.server.server_helpers`` (never under a second module name,
which would make a second copy of the module)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from inflight.runtime.config import EngineConfig
from inflight.runtime.engine_faults import FAULT_ENV
from inflight.runtime.server import ServerSettings, create_app
from inflight.runtime.server.state import STATE
from inflight.runtime.server.transport import make_runner

if TYPE_CHECKING:
    from inflight.runtime.core.engine import LLMEngine

MODEL_NAME = "demo"
# The keys and engine of the server tests' shared servers (tests/server/conftest.py); test
# files import them from here, never from a bare ``conftest`` (which names whichever
# directory's conftest was imported first when several directories run together).
API_KEY = "test-key-123"
ADMIN_KEY = "admin-key-456"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
MAIN_CONFIG = dict(max_num_sequences=4, num_kv_blocks=128, max_queue_len=64, max_model_len=512)
REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 180.0


class LiveServer:
    """``create_app`` served by an AppRunner on an ephemeral port, in a background thread.

    The engine runs in a thread of this process (tests can reach into it through ``app``), or
    with ``engine_process=True`` in an engine-core process, as ``inflight serve`` runs it.
    ``fault`` is an ``INFLIGHT_TEST_ENGINE_FAULT`` value for this server's engine alone (e.g.
    ``"slow-steps:20"`` for a test that needs requests to stay in flight): never a guess at
    how fast the engine is.
    """

    def __init__(self, model_dir: Path, config: EngineConfig, settings: ServerSettings,
                 engine_process: bool = False, fault: str = "") -> None:
        self.model_dir = model_dir
        self.config = config
        self.settings = settings
        self.engine_process = engine_process
        self.fault = fault
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    def start(self) -> LiveServer:
        self.thread.start()
        # The engine (or the engine-core process it spawns) reads the fault while it starts;
        # without ``fault`` the environment is left as the test set it.
        saved = os.environ.get(FAULT_ENV)
        if self.fault:
            os.environ[FAULT_ENV] = self.fault
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(START_TIMEOUT_S)
        finally:
            if self.fault and saved is None:
                del os.environ[FAULT_ENV]
            elif self.fault and saved is not None:
                os.environ[FAULT_ENV] = saved
        return self

    async def _start(self) -> None:
        from inflight.runtime.core.engine import LLMEngine
        from inflight.runtime.engine_core.core import CoreLaunch

        source = (CoreLaunch(str(self.model_dir), self.config, "warning", "text", stats_log=False)
                  if self.engine_process else lambda: LLMEngine.from_model_dir(self.model_dir, self.config))
        app = create_app(self.settings, source)
        self.runner = make_runner(app, self.settings.keepalive_timeout_s, self.settings.connection_limits)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]
        await app[STATE].engine.wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def app(self) -> web.Application:
        assert self.runner is not None
        return self.runner.app

    @property
    def engine(self) -> LLMEngine:
        """The in-process engine itself, for white-box checks (not with ``engine_process``)."""
        assert not self.engine_process, "the engine runs in another process"
        return self.app[STATE].engine.engine

    def stop(self) -> None:
        if self.runner is not None:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def parse_metrics(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` plus ``{'name': value}`` for single-series metrics."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        values[key] = float(value)
        values.setdefault(key.split("{", 1)[0], float(value))
    return values


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def http(method: str, url: str, body: bytes | dict | list | None = None,
         headers: dict[str, str] | None = None, timeout: float = 30.0) -> Reply:
    """One HTTP request with the standard library; error statuses are returned, not raised."""
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return Reply(resp.status, dict(resp.headers), resp.read().decode())
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, dict(exc.headers), exc.read().decode())


def metrics(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """/metrics parsed; ``headers``: a key, for a server that has one."""
    return parse_metrics(http("GET", f"{url}/metrics", headers=headers).text)


def is_idle(url: str) -> bool:
    """No request running or waiting and no KV block in use, per /metrics."""
    m = metrics(url)
    return (m["inflight:num_requests_running"] == 0 and m["inflight:num_requests_waiting"] == 0
            and m["inflight:kv_cache_usage_perc"] == 0)


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace").replace("\0", " ")
    except OSError:
        return ""


class ServeProcess:
    """A real ``python -m inflight.runtime serve`` subprocess on an ephemeral port."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "inflight.runtime", "serve", *args]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"inflight-serve-{os.getpid()}-{id(self)}.log"
        self._log = open(self.log_path, "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.port = 0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_listening(self, timeout: float = START_TIMEOUT_S) -> int:
        pattern = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")

        def found() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early ({self.proc.returncode}):\n{self.log()}")
            match = pattern.search(self.log())
            if match:
                self.port = int(match.group(1))
            return bool(match)

        if not wait_until(found, timeout, 0.1):
            raise TimeoutError(f"server did not start listening in {timeout}s:\n{self.log()}")
        return self.port

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        self.wait_listening(timeout)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early ({self.proc.returncode}):\n{self.log()}")
            try:
                return http("GET", f"{self.url}/ready", timeout=2).status == 200
            except OSError:
                return False

        if not wait_until(ready, timeout, 0.1):
            raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def server_pids(self) -> list[int]:
        """The front end and every inflight process under it (engine core, extra front ends,
        tensor-parallel workers), found by name: not multiprocessing's resource tracker."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            stat = _read(f"{entry}/stat") if entry.name.isdigit() else ""
            if stat:
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
        pids, frontier = [self.proc.pid], [self.proc.pid]
        while frontier:
            for child in children.get(frontier.pop(), []):
                frontier.append(child)
                if _read(f"/proc/{child}/comm").startswith("inflight") or \
                        "inflight.runtime.distributed.worker" in _read(f"/proc/{child}/cmdline"):
                    pids.append(child)
        return pids

    def stacks(self, settle_s: float = 2.0) -> str:
        """Every server process's Python stacks (``SIGUSR1``: written to stderr, the log) and the
        log's tail after them: what a test reports when the server did not do what it waited for."""
        size = len(self.log())
        for pid in self.server_pids():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
        wait_until(lambda: False, settle_s)  # faulthandler writes at once; give each process a moment
        return self.log()[max(0, size - 4000):]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


async def _poll_metrics(session: aiohttp.ClientSession, url: str, out: list[dict[str, float]],
                        stop: asyncio.Event, headers: dict[str, str] | None) -> None:
    while not stop.is_set():
        async with session.get(f"{url}/metrics", headers=headers) as resp:
            out.append(parse_metrics(await resp.text()))
        await asyncio.sleep(0.005)


async def _stream_all(session: aiohttp.ClientSession, url: str, max_tokens: int, prompt: str,
                      headers: dict[str, str] | None) -> int:
    num_chunks = 0
    request = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
               "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/v1/completions", json=request, headers=headers) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                num_chunks += 1
    return num_chunks


async def burst(url: str, num_streams: int, max_tokens: int, headers: dict[str, str] | None = None,
                ) -> tuple[list[int], list[dict[str, float]]]:
    """Run ``num_streams`` concurrent completion streams while sampling /metrics every ~5 ms.

    Returns the number of chunks each stream got and the metric samples."""
    samples: list[dict[str, float]] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        poller = asyncio.create_task(_poll_metrics(session, url, samples, stop, headers))
        chunks = await asyncio.gather(*[
            _stream_all(session, url, max_tokens, f"# task {i}\ndef f{i}(x):", headers) for i in range(num_streams)
        ])
        stop.set()
        await poller
    return list(chunks), samples


@dataclass
class RawReply:
    status: int  # 0: the server closed the connection without an answer
    head: str
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def raw_http(port: int, data: bytes, timeout: float = 30.0, then_wait: float = 0.0) -> RawReply:
    """Send ``data`` as-is on a new connection (optionally idle ``then_wait`` seconds first
    after sending) and read until the server closes; for requests a client library refuses."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        if then_wait:
            time.sleep(then_wait)
        chunks = []
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                raw = b"".join(chunks)
                head, sep, body = raw.partition(b"\r\n\r\n")
                match = re.search(rb"content-length: *(\d+)", head, re.I)
                if sep and match and len(body) >= int(match.group(1)):
                    break
        except ConnectionResetError:
            pass
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    return RawReply(status, head.decode("latin-1"), body)


def post_bytes(path: str, body: bytes, extra_headers: bytes = b"") -> bytes:
    """A raw POST request with ``body`` and a correct Content-Length."""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + extra_headers + b"\r\n" + body


def stream_error_code(raw: bytes) -> str | None:
    """The error code of an SSE line that is an error event, else None (a chunk whose generated
    text happens to read "error" is not one)."""
    line = raw.decode().strip()
    if not line.startswith("data: {"):
        return None
    error = json.loads(line[6:]).get("error")
    return error["code"] if isinstance(error, dict) else None


def client_for(server: LiveServer):  # noqa: ANN201 - openai is imported here only (absent on a bare GPU machine)
    """An official ``openai`` client for ``server``."""
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
