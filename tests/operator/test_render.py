"""Table-driven tests of the pure manifest builders: every spec field lands where it should."""

from __future__ import annotations

from typing import Any

import pytest

from inflight.operator import render
from inflight.operator.render import Owner
from tests.operator.helpers import make_spec

OWNER = Owner(name="demo", uid="uid-1")


def _container(deploy: dict[str, Any]) -> dict[str, Any]:
    return deploy["spec"]["template"]["spec"]["containers"][0]


def _deploy(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = make_spec(overrides)
    return render.render_deployment(spec, OWNER, render.initial_replicas(spec))


def _arg_after(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def _env(container: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((e for e in container["env"] if e["name"] == name), None)


# (overrides, getter, expected)
DEPLOYMENT_CASES = [
    ({}, lambda d: d["spec"]["replicas"], 1),
    ({"replicas": 3}, lambda d: d["spec"]["replicas"], 3),
    ({"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}},
     lambda d: d["spec"]["replicas"], 2),
    ({"image": "reg/x:1"}, lambda d: _container(d)["image"], "reg/x:1"),
    ({}, lambda d: _container(d)["image"], "ghcr.io/inflight-dev/inflight-runtime:0.1.0"),
    ({"engine": {"dtype": "bfloat16"}}, lambda d: _arg_after(_container(d)["args"], "--dtype"), "bfloat16"),
    ({"engine": {"blockSize": 32}}, lambda d: _arg_after(_container(d)["args"], "--block-size"), "32"),
    ({"engine": {"maxModelLen": 4096}}, lambda d: _arg_after(_container(d)["args"], "--max-model-len"), "4096"),
    ({"engine": {"schedulerPolicy": "priority"}},
     lambda d: _arg_after(_container(d)["args"], "--scheduler-policy"), "priority"),
    ({"engine": {"kvCacheFreeGpuMemFraction": 0.5}},
     lambda d: _arg_after(_container(d)["args"], "--kv-cache-free-gpu-mem-fraction"), "0.5"),
    ({"engine": {"enableChunkedContext": False}},
     lambda d: "--no-enable-chunked-context" in _container(d)["args"], True),
    ({"engine": {"enablePrefixCaching": True}}, lambda d: "--enable-prefix-caching" in _container(d)["args"], True),
    ({}, lambda d: "--dtype" in _container(d)["args"], False),  # unset knobs: runtime defaults
    ({"engine": {"maxNumSequences": 7}},
     lambda d: _arg_after(_container(d)["args"], "--max-num-sequences"), "$(INFLIGHT_LIVE_MAX_NUM_SEQUENCES)"),
    ({"engine": {"extraArgs": ["--seed", "3"]}}, lambda d: _container(d)["args"][-2:], ["--seed", "3"]),
    ({"model": {"pvc": {"claimName": "c", "path": "llama"}}},
     lambda d: _arg_after(_container(d)["args"], "--model"), "/models/llama"),
    ({"model": {"pvc": {"claimName": "c"}}},
     lambda d: d["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"],
     {"claimName": "c", "readOnly": True}),
    ({"model": {"hostPath": {"path": "/mnt/m"}}},
     lambda d: d["spec"]["template"]["spec"]["volumes"][0]["hostPath"]["path"], "/mnt/m"),
    ({"model": {"image": {"image": "w:1", "path": "/weights"}}},
     lambda d: d["spec"]["template"]["spec"]["initContainers"][0]["image"], "w:1"),
    ({"model": {"servedModelName": "llm", "hostPath": {"path": "/m"}}},
     lambda d: _arg_after(_container(d)["args"], "--served-model-name"), "llm"),
    ({}, lambda d: _arg_after(_container(d)["args"], "--served-model-name"), "demo"),
    ({"resources": {"gpus": 2}}, lambda d: _container(d)["resources"]["limits"]["nvidia.com/gpu"], 2),
    ({"resources": {"gpus": 0, "cpu": "4"}}, lambda d: _container(d)["resources"],
     {"requests": {"cpu": "4"}}),
    ({"resources": {"memory": "8Gi"}}, lambda d: _container(d)["resources"]["limits"]["memory"], "8Gi"),
    ({"nodeSelector": {"gpu": "h100"}}, lambda d: d["spec"]["template"]["spec"]["nodeSelector"], {"gpu": "h100"}),
    ({"tolerations": [{"key": "k", "operator": "Exists"}]},
     lambda d: d["spec"]["template"]["spec"]["tolerations"], [{"key": "k", "operator": "Exists"}]),
    ({"affinity": {"nodeAffinity": {}}}, lambda d: d["spec"]["template"]["spec"]["affinity"], {"nodeAffinity": {}}),
    ({"priorityClassName": "high"}, lambda d: d["spec"]["template"]["spec"]["priorityClassName"], "high"),
    ({"apiKeySecretRef": {"name": "s"}}, lambda d: _env(_container(d), "INFLIGHT_API_KEY"),
     {"name": "INFLIGHT_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "api-key"}}}),
    ({}, lambda d: _env(_container(d), "INFLIGHT_METRICS_API_KEY"), None),
    ({"metricsApiKeySecretRef": {"name": "prom"}}, lambda d: _env(_container(d), "INFLIGHT_METRICS_API_KEY"),
     {"name": "INFLIGHT_METRICS_API_KEY", "valueFrom": {"secretKeyRef": {"name": "prom", "key": "token"}}}),
    ({"apiKeySecretRef": {"name": "s"}, "metricsApiKeySecretRef": {"name": "s", "key": "scrape"}},
     lambda d: [e["valueFrom"]["secretKeyRef"] for e in _container(d)["env"] if "KEY" in e["name"]],
     [{"name": "s", "key": "api-key"}, {"name": "s", "key": "scrape"}, {"name": "demo-admin", "key": "admin-api-key"}]),
    ({"metricsApiKeySecretRef": {"name": "prom"}}, lambda d: "--metrics-api-key" in " ".join(_container(d)["args"]),
     False),  # the key travels in env, never in the pod's args
    ({"drainTimeoutSeconds": 50}, lambda d: d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"], 65),
    ({"drainTimeoutSeconds": 50}, lambda d: _arg_after(_container(d)["args"], "--drain-timeout"), "50"),
    ({}, lambda d: _container(d)["readinessProbe"]["httpGet"]["path"], "/ready"),
    ({}, lambda d: _container(d)["livenessProbe"]["httpGet"]["path"], "/health"),
    ({}, lambda d: _container(d)["startupProbe"]["failureThreshold"] * _container(d)["startupProbe"]["periodSeconds"],
     600),
    ({}, lambda d: _container(d)["lifecycle"]["preStop"]["exec"]["command"], ["sleep", "5"]),
    ({}, lambda d: d["spec"]["template"]["spec"]["volumes"][1], {"name": "dshm", "emptyDir": {"medium": "Memory"}}),
    ({}, lambda d: d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"], True),
    ({}, lambda d: _container(d)["securityContext"]["allowPrivilegeEscalation"], False),
    ({}, lambda d: d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"], "true"),
    ({}, lambda d: d["metadata"]["ownerReferences"][0]["uid"], "uid-1"),
    ({}, lambda d: d["spec"]["selector"]["matchLabels"],
     {"app.kubernetes.io/name": "inflight-runtime", "app.kubernetes.io/instance": "demo"}),
]


@pytest.mark.parametrize(("overrides", "getter", "expected"), DEPLOYMENT_CASES)
def test_deployment_fields(overrides: dict[str, Any], getter: Any, expected: Any) -> None:
    assert getter(_deploy(overrides)) == expected


_METRICS_ENV = {"name": "INFLIGHT_METRICS_API_KEY", "valueFrom": {"secretKeyRef": {"name": "m", "key": "t"}}}
OPEN_METRICS_CASES = [  # the runtime refuses --open-metrics beside a metrics key
    ({"apiKeySecretRef": {"name": "k"}, "inferencePool": {"enabled": True}}, True),  # the picker sends no key
    ({"apiKeySecretRef": {"name": "k"}, "inferencePool": {"enabled": True}, "env": [_METRICS_ENV]}, False),
    ({"apiKeySecretRef": {"name": "k"}, "metricsApiKeySecretRef": {"name": "m"}}, False),
    ({"apiKeySecretRef": {"name": "k"}, "env": [_METRICS_ENV]}, False),
]


@pytest.mark.parametrize(("overrides", "opened"), OPEN_METRICS_CASES)
def test_open_metrics_never_beside_a_metrics_key(overrides: dict[str, Any], opened: bool) -> None:
    assert ("--open-metrics" in _container(_deploy(overrides))["args"]) is opened


def test_grace_period_exceeds_prestop_plus_drain() -> None:
    spec = make_spec({"drainTimeoutSeconds": 30})
    assert render.termination_grace_seconds(spec) > render.PRESTOP_SLEEP_SECONDS + 30


SERVICE_CASES = [
    ({}, lambda s: (s["spec"]["type"], s["spec"]["ports"][0]["port"]), ("ClusterIP", 8000)),
    ({"service": {"type": "LoadBalancer", "port": 80}},
     lambda s: (s["spec"]["type"], s["spec"]["ports"][0]["port"]), ("LoadBalancer", 80)),
    ({}, lambda s: s["spec"]["ports"][0]["targetPort"], "http"),
]


@pytest.mark.parametrize(("overrides", "getter", "expected"), SERVICE_CASES)
def test_service_fields(overrides: dict[str, Any], getter: Any, expected: Any) -> None:
    assert getter(render.render_service(make_spec(overrides), OWNER)) == expected


def test_pdb_and_configmap() -> None:
    spec = make_spec({"engine": {"maxNumSequences": 9, "maxQueueLen": 0}})
    pdb = render.render_pdb(spec, OWNER)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": render.selector_labels("demo")}}
    cm = render.render_configmap(spec, OWNER)
    assert cm["metadata"]["name"] == "demo-live-config"
    assert cm["data"] == {"max_num_sequences": "9", "max_num_tokens": "2048", "max_queue_len": "0"}


LIVE_VS_RESTART = [
    ({"engine": {"maxNumSequences": 8}}, False),
    ({"engine": {"maxNumTokens": 512}}, False),
    ({"engine": {"maxQueueLen": 3}}, False),
    ({"engine": {"dtype": "float16"}}, True),
    ({"engine": {"blockSize": 32}}, True),
    ({"engine": {"enablePrefixCaching": False}}, True),
    ({"image": "other:2"}, True),
]


@pytest.mark.parametrize(("change", "rolls"), LIVE_VS_RESTART)
def test_live_knobs_do_not_change_the_pod_template(change: dict[str, Any], rolls: bool) -> None:
    before = _deploy({"engine": {"maxNumSequences": 4}})
    after_overrides = {"engine": {"maxNumSequences": 4, **change.get("engine", {})}}
    after_overrides.update({k: v for k, v in change.items() if k != "engine"})
    after = _deploy(after_overrides)
    assert (before["spec"]["template"] != after["spec"]["template"]) is rolls


def test_deployment_patch_nulls_removed_fields_and_leaves_replicas_to_autoscaler() -> None:
    deploy = _deploy({"autoscaling": {"enabled": True}})
    patch = render.deployment_patch(deploy, autoscaling=True)
    assert "replicas" not in patch["spec"]
    assert patch["spec"]["template"]["spec"]["nodeSelector"] is None
    assert render.deployment_patch(deploy, autoscaling=False)["spec"]["replicas"] == 1
