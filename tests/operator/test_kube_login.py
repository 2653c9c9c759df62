"""The operator logs in as kopf does when the ``kubernetes`` package is installed
(``kopf.login_via_client``): a kubeconfig whose user is an exec plugin, as GKE's
``gke-gcloud-auth-plugin`` and ``aws eks get-token`` write them, logs in, and the operator's
own client (``kubernetes.aio``) sends the plugin's token with the User-Agent the RBAC check
counts as the operator's."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import kmock
import kopf
import kubernetes.config.kube_config
import pytest
import yaml

from inflight.operator.context import default_login
from inflight.operator.kube import CONFIGMAPS, KubeClient
from tests.operator.kmock_harness import ApiServer

CREDENTIAL = {"apiVersion": "client.authentication.k8s.io/v1beta1", "kind": "ExecCredential",
              "status": {"token": "from-exec-plugin"}}


def _kubeconfig(tmp_path: Path, server: str) -> Path:
    plugin = tmp_path / "auth_plugin.py"
    plugin.write_text(f"import json\nprint(json.dumps({CREDENTIAL!r}))\n")
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1beta1", "command": sys.executable,
                     "args": [str(plugin)], "interactiveMode": "Never"}}
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "gke",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "gke", "context": {"cluster": "c", "user": "u"}}],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def test_default_login_runs_the_kubeconfigs_exec_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a cluster: kubeconfig

    async def scenario() -> None:
        async with ApiServer() as api, kmock.Server(api) as server:
            path = _kubeconfig(tmp_path, str(server.url).rstrip("/"))
            # The package reads $KUBECONFIG once, at import; point its default at ours.
            monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
            conn = default_login(kopf.OperatorSettings())()
            assert conn is not None and conn.token == "from-exec-plugin"
            kube = KubeClient(conn)
            try:
                assert await kube.get(CONFIGMAPS, "ns", "missing") is None
            finally:
                await kube.close()
            ours = [r for r in list(api) if "kmock" not in r.headers.get("User-Agent", "")]
            assert ours and {r.headers.get("User-Agent") for r in ours} == {"inflight-operator"}
            assert {r.headers.get("Authorization") for r in ours} == {"Bearer from-exec-plugin"}

    asyncio.run(scenario())


def test_default_login_without_cluster_or_kubeconfig_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "none"))
    assert default_login(kopf.OperatorSettings())() is None


def test_kube_client_sends_dict_bodies_verbatim(tmp_path: Path) -> None:
    """The client's models would refuse a field they do not know; the operator's bodies pass as written."""

    async def scenario() -> None:
        async with ApiServer() as api, kmock.Server(api) as server:
            kube = KubeClient(kopf.ConnectionInfo(server=str(server.url), insecure=True))
            try:
                body = {"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": "c", "namespace": "ns", "fieldFromANewerRelease": "x"},
                        "data": {"a": "1"}}
                created = await kube.create(CONFIGMAPS, "ns", body)
                assert created["metadata"]["fieldFromANewerRelease"] == "x"
            finally:
                await kube.close()
            posts = [r for r in list(api) if r.method.value == "POST" and "configmaps" in str(r.url.path)]
            assert json.loads(json.dumps(posts[0].data))["metadata"]["fieldFromANewerRelease"] == "x"

    asyncio.run(scenario())
