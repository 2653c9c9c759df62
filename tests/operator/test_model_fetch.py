"""The hf model source end to end, offline: the rendered ``model-fetch`` init container's command
runs against a fake Hub on 127.0.0.1, the files land in the directory the runtime container's
``--model`` names, a restart finds them in the cache without contacting the Hub, and the runtime
(``inflight serve`` with the rendered args) serves from them."""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

import aiohttp
import pytest

from inflight.operator import render, render_model
from inflight.operator.render import Owner
from tests.operator.fake_hub import COMMIT, FakeHub
from tests.operator.helpers import REPO, make_spec

TOKEN = "hf_fake_secret_token_123"
HF_SPEC = {"model": {"servedModelName": "tiny", "hf": {"repoId": "org/tiny-llama", "revision": "main",
                                                         "tokenSecretRef": {"name": "hf-token"}},
                     "cache": {"size": "10Gi"}},
           "resources": {"gpus": 0}, "engine": {"maxNumSequences": 4}}


@pytest.fixture(scope="module")
def demo_repo(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    model = tmp_path_factory.mktemp("hub") / "tiny"
    subprocess.run([sys.executable, "-m", "inflight.runtime.demo.model", str(model), "--size", "tiny"],
                   check=True, capture_output=True, timeout=120)
    return model


def _rooted(path: str, root: pathlib.Path) -> str:
    """A container path under /models, moved under ``root`` (the test's stand-in for the volume)."""
    return str(root / path[len(render_model.MODEL_MOUNT) + 1:]) if path.startswith(render_model.MODEL_MOUNT) else path


def _init_container(spec: Any) -> dict[str, Any]:
    deploy = render.render_deployment(spec, Owner("tiny", "u1"), 1)
    return deploy["spec"]["template"]["spec"]["initContainers"][0]


async def _run_fetch(container: dict[str, Any], root: pathlib.Path, hub: FakeHub, token: str) -> tuple[int, str]:
    """The init container's command and env, as the kubelet would run it, with /models -> ``root``."""
    # The runtime image sets HF_HUB_OFFLINE=1 (docker/runtime.Dockerfile); the rendered env must undo it.
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "1"}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = _rooted(var["value"], root) if var["name"] != "HF_HOME" else str(root / ".hf-home")
        elif var["valueFrom"]["secretKeyRef"]["name"] == "hf-token":
            env[var["name"]] = token  # what the Secret would hold
    cmd = [sys.executable if c == "python" else _rooted(c, root) for c in container["command"]]
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, cwd=REPO, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode or 0, out.decode()


def test_rendered_fetch_container_and_volumes() -> None:
    spec = make_spec(HF_SPEC)
    deploy = render.render_deployment(spec, Owner("demo", "u1"), 1)
    pod = deploy["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    path = "/models/hf/org--tiny-llama/main"
    assert init["command"] == [
        "python", "-m", "inflight.operator.model_fetch", "--repo-id", "org/tiny-llama", "--revision", "main",
        "--dest", path, "--allow-pattern", "*.json", "--allow-pattern", "*.safetensors",
        "--allow-pattern", "*.model", "--allow-pattern", "*.txt", "--allow-pattern", "*.jinja"]
    assert init["image"] == spec.image
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in init["env"]
    runtime = pod["containers"][0]
    assert runtime["args"][runtime["args"].index("--model") + 1] == path
    assert pod["volumes"][0] == {"name": "model", "persistentVolumeClaim": {"claimName": "demo-model-cache"}}
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in runtime["volumeMounts"]
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
    pvc = render.render_cache_pvc(spec, Owner("demo", "u1"))
    assert pvc["metadata"]["name"] == "demo-model-cache"
    assert pvc["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}


@pytest.mark.slow
def test_init_container_fetches_from_a_fake_hub_and_the_runtime_serves_the_files(
    demo_repo: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    spec = make_spec(HF_SPEC, name="tiny")
    container = _init_container(spec)
    volume = tmp_path / "cache-pvc"

    async def fetch_twice() -> None:
        hub = await FakeHub("org/tiny-llama", demo_repo, token=TOKEN).start()
        try:
            rc, out = await _run_fetch(container, volume, hub, TOKEN)
            assert rc == 0, out
            assert f"commit {COMMIT}" in out and "downloaded" in out
            assert TOKEN not in out
            assert all(auth == f"Bearer {TOKEN}" for _, _, auth in hub.requests)
            first = len(hub.requests)
            rc, out = await _run_fetch(container, volume, hub, TOKEN)  # a restart / second replica
            assert rc == 0 and "already in the cache" in out, out
            assert len(hub.requests) == first  # the Hub was not contacted again
            rc, out = await _run_fetch(container, tmp_path / "other", hub, "hf_wrong")
            assert rc == 1 and "failed" in out and "hf_wrong" not in out, out
        finally:
            await hub.stop()

    asyncio.run(fetch_twice())
    model_dir = pathlib.Path(_rooted(render_model.model_path(spec.model), volume))
    wanted = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    assert wanted <= {p.name for p in model_dir.iterdir()}
    for name in wanted:
        assert (model_dir / name).read_bytes() == (demo_repo / name).read_bytes()
    _serve_and_complete(spec, volume)


def _serve_and_complete(spec: Any, volume: pathlib.Path) -> None:
    """Run the runtime container's rendered args (``$(VAR)`` expanded from the ConfigMap) and complete."""
    live = render.render_configmap(spec, Owner("tiny", "u1"))["data"]
    env = {f"INFLIGHT_LIVE_{k.upper()}": v for k, v in live.items()}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in render.runtime_args(spec)]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    args[args.index("--model") + 1] = _rooted(args[args.index("--model") + 1], volume)
    proc = subprocess.Popen([sys.executable, "-m", "inflight.runtime", *args, "--num-kv-blocks", "128"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"runtime did not become ready: {proc.communicate()[1].decode()[-2000:]}")
            time.sleep(0.3)

        async def complete() -> dict[str, Any]:
            async with aiohttp.ClientSession() as session:
                body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

        out = asyncio.run(complete())
        assert out["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _pod(init_state: dict[str, Any] | None, last: dict[str, Any] | None = None) -> dict[str, Any]:
    statuses = [] if init_state is None else [{"name": "model-fetch", "state": init_state, "lastState": last or {}}]
    return {"metadata": {"name": "p"}, "status": {"initContainerStatuses": statuses}}


@pytest.mark.parametrize(
    ("pods", "state"),
    [
        ([], "Pending"),
        ([_pod(None)], "Pending"),
        ([_pod({"running": {}})], "Downloading"),
        ([_pod({"terminated": {"exitCode": 0}})], "Ready"),
        ([_pod({"running": {}}), _pod({"terminated": {"exitCode": 0}})], "Ready"),
        ([_pod({"terminated": {"exitCode": 1, "message": "401"}})], "Failed"),
        ([_pod({"waiting": {"reason": "CrashLoopBackOff"}}, {"terminated": {"exitCode": 1}})], "Failed"),
        ([_pod({"waiting": {"reason": "PodInitializing"}})], "Pending"),
    ],
)
def test_cache_status_from_init_container_states(pods: list[dict[str, Any]], state: str) -> None:
    spec = make_spec(HF_SPEC)
    status = render_model.cache_status(spec.name, spec.model, pods)
    assert status["state"] == state
    assert status["volume"] == "pvc/demo-model-cache" and status["path"] == "/models/hf/org--tiny-llama/main"


def test_cache_status_only_for_hf_and_names_emptydir() -> None:
    assert render_model.cache_status("demo", make_spec({}).model, []) is None
    spec = make_spec({"model": {"hf": {"repoId": "a/b"}}})
    assert render_model.cache_status("demo", spec.model, [])["volume"].startswith("emptyDir")


def test_fetch_refuses_a_repo_without_a_model_config(demo_repo: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """allowPatterns that leave out config.json (or a repo that is not a model): exit 1, no marker."""
    spec = make_spec({"model": {"hf": {"repoId": "org/tiny-llama", "allowPatterns": ["*.safetensors"]}}}, name="tiny")

    async def run() -> tuple[int, str]:
        hub = await FakeHub("org/tiny-llama", demo_repo).start()
        try:
            return await _run_fetch(_init_container(spec), tmp_path, hub, "")
        finally:
            await hub.stop()

    rc, out = asyncio.run(run())
    assert rc == 1 and "has no config.json" in out, out
    dest = pathlib.Path(_rooted(render_model.model_path(spec.model), tmp_path))
    assert not (dest / ".inflight-fetch.json").exists()  # the next pod start tries again
