"""Pod helpers (readiness, URL, metric parsing), status conditions, settings, CLI argv, kube client."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import subprocess
import sys
from typing import Any

import aiohttp
import kmock
import kopf
import pytest

from inflight.operator import metrics_scrape, status
from inflight.operator.__main__ import build_argv
from inflight.operator.context import OperatorConfig
from inflight.operator.kube import CONFIGMAPS, INFERENCE_POOLS, PVCS, SECRETS, KubeClient, KubeError
from tests.operator.kmock_harness import ApiServer, FakePod, pod_object

METRICS_TEXT = """\
# HELP inflight:kv_cache_usage_perc KV-cache usage.
# TYPE inflight:kv_cache_usage_perc gauge
inflight:kv_cache_usage_perc{model_name="m"} 0.42
# TYPE inflight:num_requests_waiting gauge
inflight:num_requests_waiting{model_name="m"} 7.0
# TYPE inflight:num_requests_running gauge
inflight:num_requests_running{model_name="m"} 4.0
# TYPE inflight:time_to_first_token_seconds histogram
inflight:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3.0
inflight:time_to_first_token_seconds_count{model_name="m"} 3.0
inflight:time_to_first_token_seconds_sum{model_name="m"} 0.3
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (METRICS_TEXT, (0.42, 7.0)),
        ("# TYPE inflight:num_requests_waiting gauge\ninflight:num_requests_waiting 2\n", (None, 2.0)),
        ("", (None, None)),
    ],
)
def test_parse_metrics(text: str, expected: tuple[float | None, float | None]) -> None:
    assert metrics_scrape.parse_metrics(text) == expected


def _pod(**status_fields: Any) -> dict[str, Any]:
    pod = pod_object("p", "demo", 9000)
    pod["status"].update(status_fields)
    return pod


@pytest.mark.parametrize(
    ("pod", "ready"),
    [
        (_pod(), True),
        (_pod(phase="Pending"), False),
        (_pod(conditions=[{"type": "Ready", "status": "False"}]), False),
        (_pod(conditions=[]), False),
        ({**_pod(), "metadata": {**_pod()["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}, False),
    ],
)
def test_pod_is_ready(pod: dict[str, Any], ready: bool) -> None:
    assert metrics_scrape.pod_is_ready(pod) is ready


def test_pod_target_uses_the_port_named_http_never_the_annotation() -> None:
    pod = _pod()
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "15020"  # a mesh rewrote it
    assert metrics_scrape.pod_target(pod).base_url == "http://127.0.0.1:9000"
    sidecar = {"name": "istio-proxy", "ports": [{"name": "http", "containerPort": 15090}]}
    pod["spec"]["containers"].insert(0, sidecar)  # injected first: the runtime's port still wins
    assert metrics_scrape.pod_target(pod).base_url == "http://127.0.0.1:9000"
    del pod["spec"]["containers"][1]["ports"]
    pod["spec"]["containers"][0]["name"] = "runtime-sidecar"
    pod["spec"]["containers"][0]["ports"][0]["name"] = "metrics"
    assert metrics_scrape.pod_target(pod).base_url == "http://127.0.0.1:8000"  # the rendered default
    assert metrics_scrape.pod_target(_pod(podIP=None)) is None
    assert metrics_scrape.pod_target(_pod(podIP="fd00::1")).base_url == "http://[fd00::1]:9000"


def test_scrape_and_push_against_a_fake_pod() -> None:
    async def scenario() -> None:
        pod = await FakePod(kv_cache_usage=0.5, num_waiting=3).start()
        try:
            target = metrics_scrape.PodTarget("p", f"http://127.0.0.1:{pod.port}")
            dead = metrics_scrape.PodTarget("dead", "http://127.0.0.1:1")
            async with aiohttp.ClientSession() as session:
                got = await metrics_scrape.scrape_pods(session, [target, dead], 2.0)
                error = await metrics_scrape.push_live_config(session, target, {"max_queue_len": 3}, "k", 2.0)
                dead_error = await metrics_scrape.push_live_config(session, dead, {}, None, 2.0)
        finally:
            await pod.stop()
        assert [(g.metrics.kv_cache_usage, g.metrics.num_waiting) for g in got] == [(0.5, 3.0), (None, None)]
        assert got[0].error is None and got[1].error.startswith("dead at http://127.0.0.1:1/metrics:")
        assert error is None and pod.admin_posts == [({"max_queue_len": 3}, "Bearer k")]
        assert dead_error is not None and dead_error.startswith("dead:")

    asyncio.run(scenario())


def test_condition_transition_time_changes_only_with_status() -> None:
    first = status.merge_conditions(None, [status.Condition("Ready", False, "A", "a")], 100.0, 1)
    same = status.merge_conditions(first, [status.Condition("Ready", False, "B", "b")], 200.0, 2)
    flipped = status.merge_conditions(same, [status.Condition("Ready", True, "C", "c")], 300.0, 2)
    assert same[0]["lastTransitionTime"] == first[0]["lastTransitionTime"] == status.rfc3339(100.0)
    assert same[0]["reason"] == "B" and same[0]["observedGeneration"] == 2
    assert flipped[0]["lastTransitionTime"] == status.rfc3339(300.0)


@pytest.mark.parametrize(
    ("deploy_status", "replicas", "ready_cond", "available"),
    [
        ({"readyReplicas": 2, "updatedReplicas": 2, "replicas": 2}, 2, ("True", "AllReplicasReady"), "True"),
        ({"readyReplicas": 1, "updatedReplicas": 2, "replicas": 2}, 2, ("False", "PartiallyReady"), "True"),
        ({}, 2, ("False", "NoReplicasReady"), "False"),
        ({}, 0, ("False", "ScaledToZero"), "False"),
    ],
)
def test_observed_status(
    deploy_status: dict[str, Any], replicas: int, ready_cond: tuple[str, str], available: str
) -> None:
    deploy = {"spec": {"replicas": replicas}, "status": deploy_status}
    out = status.observed_status(deploy, None, [], 3, 0.0)
    ready = next(c for c in out["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ready_cond
    assert next(c for c in out["conditions"] if c["type"] == "Available")["status"] == available
    assert out["desiredReplicas"] == replicas


def test_operator_config_from_env() -> None:
    default = OperatorConfig.from_env({})
    assert default.identity  # a unique name even without POD_NAME (the hostname and pid)
    assert dataclasses.replace(default, identity="") == OperatorConfig()
    assert OperatorConfig.from_env({"POD_NAME": "op-0", "INFLIGHT_OPERATOR_LEASE_NAME": "l"}).identity == "op-0"
    cfg = OperatorConfig.from_env({"INFLIGHT_OPERATOR_TICK_SECONDS": "0.5"})
    assert cfg.tick_seconds == 0.5
    with pytest.raises(ValueError, match="INFLIGHT_OPERATOR_TICK_SECONDS must be a number"):
        OperatorConfig.from_env({"INFLIGHT_OPERATOR_TICK_SECONDS": "soon"})
    with pytest.raises(ValueError, match="tick_seconds must be a number > 0"):
        OperatorConfig(tick_seconds=0)
    refusals = OperatorConfig.from_env({"INFLIGHT_OPERATOR_API_TIMEOUT_SECONDS": "10", "INFLIGHT_OPERATOR_RETRY_BASE_SECONDS": "1",
                                        "INFLIGHT_OPERATOR_RETRY_MAX_SECONDS": "60", "INFLIGHT_OPERATOR_FULL_CHECK_EVERY_TICKS": "2"})
    assert (refusals.api_timeout_seconds, refusals.retry_base_seconds, refusals.retry_max_seconds,
            refusals.full_check_every_ticks) == (10.0, 1.0, 60.0, 2)
    with pytest.raises(ValueError, match="full_check_every_ticks must be an integer >= 1"):
        OperatorConfig.from_env({"INFLIGHT_OPERATOR_FULL_CHECK_EVERY_TICKS": "0"})


@pytest.mark.parametrize(
    ("args", "expected_tail"),
    [
        ([], ["--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]),
        (["-n", "team-a"], ["-n", "team-a", "--liveness=http://0.0.0.0:8080/healthz"]),
        (["--liveness=http://0.0.0.0:9090/z", "-A"], ["--liveness=http://0.0.0.0:9090/z", "-A"]),
    ],
)
def test_main_builds_kopf_run_argv(args: list[str], expected_tail: list[str]) -> None:
    argv = build_argv(args)
    assert argv[:3] == ["run", "-m", "inflight.operator.kopf_main"]
    assert argv[3:] == expected_tail


def test_kube_client_apply_patches_on_conflict_and_reads_secrets() -> None:
    async def scenario() -> None:
        async with ApiServer() as api, kmock.Server(api) as server:
            kube = KubeClient(kopf.ConnectionInfo(server=str(server.url), insecure=True))
            try:
                cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "ns"},
                      "data": {"a": "1"}}
                await kube.apply(CONFIGMAPS, "ns", cm)
                await kube.apply(CONFIGMAPS, "ns", {**cm, "data": {"a": "2"}})  # 409 -> merge patch
                assert (await kube.get(CONFIGMAPS, "ns", "c"))["data"] == {"a": "2"}
                assert await kube.get(CONFIGMAPS, "ns", "missing") is None
                secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s", "namespace": "ns"},
                          "data": {"api-key": base64.b64encode(b"k3y").decode()}}
                await kube.create(SECRETS, "ns", secret)
                assert (await kube.get(SECRETS, "ns", "s"))["data"] == secret["data"]
                assert await kube.delete(CONFIGMAPS, "ns", "c") is True
                assert await kube.delete(CONFIGMAPS, "ns", "c") is False
                with pytest.raises(KubeError) as info:
                    await kube.patch(CONFIGMAPS, "ns", "c", {"data": {}})
                assert info.value.status == 404
            finally:
                await kube.close()

    asyncio.run(scenario())


def test_operator_imports_no_torch() -> None:
    """The operator image is slim: importing the operator must not pull in torch."""
    code = "import sys, inflight.operator, inflight.operator.handlers; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_kube_client_merge_patches_and_custom_objects() -> None:
    async def scenario() -> None:
        async with ApiServer() as api, kmock.Server(api) as server:
            conn = kopf.ConnectionInfo(server=str(server.url), insecure=True, token="s3cr3t-token")
            kube = KubeClient(conn)
            try:
                secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "a", "namespace": "ns"},
                          "data": {"k": base64.b64encode(b"one").decode()}}
                assert await kube.create_if_missing(SECRETS, "ns", secret) is True
                other = {**secret, "data": {"k": base64.b64encode(b"two").decode()}}
                assert await kube.create_if_missing(SECRETS, "ns", other) is False  # never replaced
                assert (await kube.get(SECRETS, "ns", "a"))["data"] == secret["data"]
                pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                        "metadata": {"name": "p", "namespace": "ns"},
                        "spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}]}}
                await kube.apply(INFERENCE_POOLS, "ns", pool)
                await kube.apply(INFERENCE_POOLS, "ns", {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 9}]}})
                got = await kube.get(INFERENCE_POOLS, "ns", "p")
                assert got["spec"]["targetPorts"] == [{"number": 9}]
                pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "c", "namespace": "ns"},
                       "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}}
                await kube.create(PVCS, "ns", pvc)
                typed = await kube.get(PVCS, "ns", "c")  # built by CoreV1Api, read back as JSON
                assert typed["spec"]["accessModes"] == ["ReadWriteMany"]
                assert typed["spec"]["resources"]["requests"] == {"storage": "1Gi"}
            finally:
                await kube.close()
            patches = [r for r in list(api) if r.method.value == "PATCH"]
            assert patches and {r.headers.get("Content-Type") for r in patches} == {"application/merge-patch+json"}
            ours = [r for r in list(api) if "kmock" not in r.headers.get("User-Agent", "")]
            assert {r.headers.get("User-Agent") for r in ours} == {"inflight-operator"}
            assert {r.headers.get("Authorization") for r in ours} == {"Bearer s3cr3t-token"}

    asyncio.run(scenario())


def test_kube_configuration_materializes_kubeconfig_data(tmp_path: Any) -> None:
    from inflight.operator.kube import _configuration

    pem = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    conn = kopf.ConnectionInfo(server="https://k8s.example:6443/", ca_data=base64.b64encode(pem).decode(),
                               certificate_data=pem, private_key_data=pem)
    config = _configuration(conn, str(tmp_path))
    assert config.host == "https://k8s.example:6443" and config.verify_ssl is True
    for path in (config.ssl_ca_cert, config.cert_file, config.key_file):
        assert open(path, "rb").read() == pem
        assert (os.stat(path).st_mode & 0o777) == 0o600
    assert _configuration(kopf.ConnectionInfo(server="http://x", insecure=True), str(tmp_path)).verify_ssl is False


def test_importing_operator_modules_registers_nothing_but_kopf_main_does() -> None:
    """No import side effects: only the module ``kopf run`` loads touches kopf's registry."""
    code = (
        "import importlib, pkgutil, sys, kopf, inflight.operator as op\n"
        "names = [m.name for m in pkgutil.iter_modules(op.__path__) if m.name not in ('kopf_main', '__main__')]\n"
        "for name in names: importlib.import_module(f'inflight.operator.{name}')\n"
        "registry = kopf.get_default_registry()\n"
        "before = len(list(registry._changing.get_all_handlers())) + len(list(registry._spawning.get_all_handlers()))\n"
        "import inflight.operator.kopf_main\n"
        "after = len(list(registry._changing.get_all_handlers())) + len(list(registry._spawning.get_all_handlers()))\n"
        "print(len(names), before, after)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    modules, before, after = map(int, out.stdout.split())
    assert modules > 20 and before == 0 and after > 0, out.stdout
