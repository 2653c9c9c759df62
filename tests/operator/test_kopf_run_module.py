"""``kopf run -m inflight.operator`` (the package, not ``.kopf_main``) starts a working operator,
and importing the package anywhere else registers nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import socket
import subprocess
import sys

import kmock
import yaml

from inflight.operator import crd
from tests.operator.helpers import EXAMPLES, REPO, load_example
from tests.operator.kmock_harness import ApiServer, Cluster, wait_for


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_kopf_run_of_the_package_reconciles(tmp_path: pathlib.Path) -> None:
    async def scenario() -> None:
        async with ApiServer() as api, kmock.Server(api) as server:
            cluster = Cluster(api)
            await cluster.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd.build_crd())
            (tmp_path / "kubeconfig").write_text(yaml.safe_dump({
                "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
                "clusters": [{"name": "kmock", "cluster": {"server": str(server.url).rstrip("/")}}],
                "users": [{"name": "u", "user": {"token": "t0ken"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u"}}],
            }))
            env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig"),
                   "INFLIGHT_OPERATOR_TICK_SECONDS": "0.5", "HOME": str(tmp_path)}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kopf", "run", "-m", "inflight.operator", "--standalone", "-A",
                f"--liveness=http://127.0.0.1:{_free_port()}/healthz", cwd=REPO, env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                await cluster.create_cr(load_example(next(p for p in EXAMPLES if p.stem == "minimal")))
                await wait_for(lambda: cluster.child("deployments", "llama-minimal"), timeout=40,
                               what="Deployment created by `kopf run -m inflight.operator`")
            finally:
                proc.terminate()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), 15)
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    asyncio.run(asyncio.wait_for(scenario(), 90))


def test_importing_the_package_registers_nothing() -> None:
    code = ("import kopf, inflight.operator, inflight.operator.handlers; "
            "print(len(list(kopf.get_default_registry()._spawning.get_all_handlers())) + "
            "len(list(kopf.get_default_registry()._changing.get_all_handlers())))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0", out.stderr
