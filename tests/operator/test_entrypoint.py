"""``python -m inflight.operator`` as a process: kubeconfig login, liveness endpoint, reconciling."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import socket
import sys

import aiohttp
import kmock
import yaml

from inflight.operator import crd
from tests.operator.helpers import EXAMPLES, REPO, load_example
from tests.operator.kmock_harness import ApiServer, Cluster, wait_for


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _kubeconfig(path: pathlib.Path, server: str) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t0ken"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "u"}}],
    }))


def test_module_entrypoint_serves_liveness_and_reconciles(tmp_path: pathlib.Path) -> None:
    async def scenario() -> None:
        async with ApiServer() as api, kmock.Server(api) as server:
            cluster = Cluster(api)
            await cluster.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd.build_crd())
            _kubeconfig(tmp_path / "kubeconfig", str(server.url).rstrip("/"))
            port = _free_port()
            env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig"),
                   "INFLIGHT_OPERATOR_TICK_SECONDS": "0.5", "HOME": str(tmp_path)}
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "inflight.operator", "--standalone",
                f"--liveness=http://127.0.0.1:{port}/healthz", cwd=REPO, env=env,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                async def alive() -> bool:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with aiohttp.ClientSession() as session:
                            async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                                return resp.status == 200 and (await resp.json()).get("logged_in") is True
                    return False

                await wait_for(alive, timeout=30, what="liveness endpoint")
                doc = load_example(next(p for p in EXAMPLES if p.stem == "minimal"))
                await cluster.create_cr(doc)
                await wait_for(lambda: cluster.child("deployments", "llama-minimal"), timeout=20,
                               what="Deployment created by the operator process")
                auth = {r.headers.get("Authorization") for r in list(api) if "kopf" in r.headers.get("User-Agent", "")}
                assert auth == {"Bearer t0ken"}
            finally:
                proc.terminate()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(proc.wait(), 15)
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()

    asyncio.run(asyncio.wait_for(scenario(), 90))
