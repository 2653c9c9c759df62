"""Real ``inflight serve`` processes on 127.0.0.1 standing in for an InferenceDeployment's pods,
and the kubelet's part of keeping pod objects in line with the Deployment's replicas: what the
end-to-end autoscaling tests share.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.operator.kmock_harness import Cluster, pod_object

PODS = "/api/v1/namespaces/default/pods"
READY_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def runtime_processes(model: Path, log_dir: Path, args: Sequence[str], admin_key: str,
                      count: int = 2) -> Iterator[list[int]]:
    """``count`` runtimes serving ``model`` as "demo" with ``args`` (logs in ``log_dir``), each
    with ``admin_key``; yields their ports once every one is ready, stops them all after."""
    ports = [free_port() for _ in range(count)]
    logs = [(log_dir / f"server-{i}.log").open("w") for i in range(count)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "inflight.runtime", "serve", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--served-model-name", "demo", "--drain-timeout", "1", *args],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "INFLIGHT_ADMIN_API_KEY": admin_key},
        )
        for port, log in zip(ports, logs, strict=True)
    ]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(ready(p) for p in ports):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail(f"inflight serve did not become ready; logs in {log_dir}")
            time.sleep(0.3)
        yield ports
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
            if proc.poll() is None:
                proc.kill()
        for log in logs:
            log.close()


async def sync_pods(cluster: Cluster, name: str, ports: Sequence[int]) -> int | None:
    """One kubelet round: a pod object per wanted replica (pod i answers on ``ports[i]``), none
    past them. The Deployment's replicas, or None while it does not exist."""
    deploy = await cluster.child("deployments", name)
    if deploy is None:
        return None
    replicas = deploy["spec"].get("replicas", 0)
    for i, port in enumerate(ports):
        pod_name = f"{name}-{i}"
        exists = await cluster.get(f"{PODS}/{pod_name}") is not None
        if i < replicas and not exists:
            await cluster.create(PODS, pod_object(pod_name, name, port))
        elif i >= replicas and exists:
            await cluster.request("DELETE", f"{PODS}/{pod_name}")
    return replicas
