"""The systems under test: how to start each server on 127.0.0.1, wait until it is ready, stop it.

A :class:`SystemSpec` is a name plus either a server command (``inflight serve`` with some
engine flags, ``transformers serve --continuous-batching``, vLLM's CPU build or llama.cpp's
``llama-server``, the last two installed by :mod:`inflight.bench.peers`) or ``in_process`` for
the plain ``transformers`` ``generate`` baseline (see :mod:`inflight.bench.hf_static`).
:class:`RunningServer` owns one subprocess: free port, bounded readiness wait (plus one
warm-up request, so no system pays its start-up cost inside a measurement; both are timed, for
the report), and a stop that escalates from SIGTERM to SIGKILL. Knows nothing about workloads
or reports.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from inflight.bench.client import RequestSpec, run_workload
from inflight.bench.run_context import process_tree

HOST = "127.0.0.1"
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0


@dataclass(frozen=True, slots=True)
class SystemSpec:
    """One system: ``kind`` is ``inflight``, ``transformers-serve``, ``vllm``, ``llama-server`` or
    ``hf-generate``."""

    name: str
    kind: str
    flags: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    batch_size: int = 0  # hf-generate only: requests per padded batch
    exe: str = ""  # vllm: its environment's python; llama-server: the binary
    model_file: str = ""  # llama-server: the GGUF file converted from the model directory

    @property
    def in_process(self) -> bool:
        return self.kind == "hf-generate"


@dataclass(slots=True)
class RunningServer:
    """A started server subprocess; use as a context manager."""

    spec: SystemSpec
    model_dir: Path
    log_path: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float = float("nan")  # start to ready
    first_request_s: float = float("nan")  # the warm-up request, after ready
    _log: object = field(default=None, repr=False)
    _started: float = field(default=0.0, repr=False)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def model_name(self) -> str:
        return "bench" if self.spec.kind == "inflight" else str(self.model_dir)

    def command(self) -> list[str]:
        if self.spec.kind == "inflight":
            return [sys.executable, "-m", "inflight.runtime", "serve", "--model", str(self.model_dir),
                    "--served-model-name", "bench", "--host", HOST, "--port", str(self.port),
                    "--log-level", "warning", *self.spec.flags]
        if self.spec.kind == "transformers-serve":
            exe = str(Path(sys.executable).with_name("transformers"))
            return [exe, "serve", str(self.model_dir), "--continuous-batching", "--device", "cpu",
                    "--dtype", "float32", "--host", HOST, "--port", str(self.port), *self.spec.flags]
        if self.spec.kind == "vllm":
            # Its `vllm` command looks for a distribution named `vllm`; the module works.
            return [self.spec.exe, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                    "--dtype", "float32", "--host", HOST, "--port", str(self.port), *self.spec.flags]
        if self.spec.kind == "llama-server":
            return [self.spec.exe, "-m", self.spec.model_file, "--host", HOST, "--port", str(self.port),
                    *self.spec.flags]
        raise ValueError(f"{self.spec.name} is not a server (kind {self.spec.kind!r})")

    def __enter__(self) -> RunningServer:
        self.port = free_port()
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **dict(self.spec.env)}
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in __exit__
        self._started = time.monotonic()
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        path = "/ready" if self.spec.kind == "inflight" else "/health"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode}; see {self.log_path}")
            if http_ok(self.url + path):
                break
            time.sleep(0.5)
        else:
            raise TimeoutError(f"{self.spec.name} not ready after {READY_TIMEOUT_S:.0f}s; see {self.log_path}")
        ready = time.monotonic()
        self.startup_s = ready - self._started
        warm = run_workload(self.url, self.model_name, [RequestSpec("warm up the server", 4)], 120.0)
        self.first_request_s = time.monotonic() - ready
        if warm.results[0].error:
            raise RuntimeError(f"{self.spec.name} warm-up failed: {warm.results[0].error}")

    def cpu_seconds(self) -> float:
        """User + system CPU seconds of the server and every process it started, so far."""
        import psutil

        if self.proc is None:
            return 0.0
        total = 0.0
        for proc in process_tree(self.proc.pid):
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(STOP_TIMEOUT_S)
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - 127.0.0.1 only
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False
