"""Table-driven tests of the fields added for real clusters: model sources and cache, pod
passthrough, rollout, tensor parallelism, admin Secret, InferencePool; every rendered object is
validated against the Kubernetes schemas and the InferencePool against the extension's CRD."""

from __future__ import annotations

import base64
import copy
import pathlib
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from inflight.operator import render, render_pool
from inflight.operator.render import Owner
from tests.operator.helpers import EXAMPLES, load_example, make_spec
from tests.operator.test_spec_and_crd import K8S_VERSION

OWNER = Owner(name="demo", uid="0b7c4e1e-0000-4000-8000-000000000001")
POOL_SCHEMA = yaml.safe_load((pathlib.Path(__file__).parent / "data" / "inferencepool-v1-schema.yaml").read_text())


def _deploy(overrides: dict[str, Any]) -> dict[str, Any]:
    spec = make_spec(overrides)
    return render.render_deployment(spec, OWNER, render.initial_replicas(spec))


def _pod(d: dict[str, Any]) -> dict[str, Any]:
    return d["spec"]["template"]["spec"]


def _c(d: dict[str, Any]) -> dict[str, Any]:
    return _pod(d)["containers"][0]


def _arg(d: dict[str, Any], flag: str) -> str | None:
    args = _c(d)["args"]
    return args[args.index(flag) + 1] if flag in args else None


def _env(d: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((e for e in _c(d)["env"] if e["name"] == name), None)


HF = {"hf": {"repoId": "Qwen/Qwen2.5-7B-Instruct", "revision": "a09a3545"}}
ENV = [{"name": "HF_HUB_OFFLINE", "value": "1"},
       {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
VOLUMES = [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}]
MOUNTS = [{"name": "scratch", "mountPath": "/scratch"}]

# (overrides, getter, expected)
CASES = [
    # model sources
    ({"model": HF}, lambda d: _arg(d, "--model"), "/models/hf/Qwen--Qwen2.5-7B-Instruct/a09a3545"),
    ({"model": HF}, lambda d: _pod(d)["volumes"][0], {"name": "model", "emptyDir": {}}),
    ({"model": {**HF, "cache": {"claimName": "shared-models"}}}, lambda d: _pod(d)["volumes"][0],
     {"name": "model", "persistentVolumeClaim": {"claimName": "shared-models"}}),
    ({"model": {**HF, "cache": {"size": "200Gi"}}}, lambda d: _pod(d)["volumes"][0]["persistentVolumeClaim"],
     {"claimName": "demo-model-cache"}),
    ({"model": HF}, lambda d: _pod(d)["initContainers"][0]["name"], "model-fetch"),
    ({"model": {"hf": {**HF["hf"], "image": "tools/fetch:1"}}}, lambda d: _pod(d)["initContainers"][0]["image"],
     "tools/fetch:1"),
    ({"model": HF}, lambda d: any(e["name"] == "HF_TOKEN" for e in _pod(d)["initContainers"][0]["env"]), False),
    ({"model": {"hf": {**HF["hf"], "allowPatterns": ["*.json", "*.safetensors"]}}},
     lambda d: _pod(d)["initContainers"][0]["command"][-4:],
     ["--allow-pattern", "*.json", "--allow-pattern", "*.safetensors"]),
    ({"model": HF}, lambda d: {"name": "hf-home", "emptyDir": {}} in _pod(d)["volumes"], True),
    ({"model": {"hf": {**HF["hf"], "endpoint": "https://mirror.example.com"}}},
     lambda d: {"name": "HF_ENDPOINT", "value": "https://mirror.example.com"} in _pod(d)["initContainers"][0]["env"],
     True),
    ({"model": HF}, lambda d: _c(d)["volumeMounts"][0], {"name": "model", "mountPath": "/models", "readOnly": True}),
    # pod passthrough
    ({"imagePullSecrets": [{"name": "regcred"}]}, lambda d: _pod(d)["imagePullSecrets"], [{"name": "regcred"}]),
    ({"env": ENV}, lambda d: _c(d)["env"][-2:], ENV),
    ({"envFrom": [{"secretRef": {"name": "s3"}}]}, lambda d: _c(d)["envFrom"], [{"secretRef": {"name": "s3"}}]),
    ({"volumes": VOLUMES, "volumeMounts": MOUNTS}, lambda d: _pod(d)["volumes"][-1], VOLUMES[0]),
    ({"volumes": VOLUMES, "volumeMounts": MOUNTS}, lambda d: _c(d)["volumeMounts"][-1], MOUNTS[0]),
    ({"runtimeClassName": "nvidia"}, lambda d: _pod(d)["runtimeClassName"], "nvidia"),
    ({"podAnnotations": {"team": "llm"}}, lambda d: d["spec"]["template"]["metadata"]["annotations"]["team"], "llm"),
    ({"podAnnotations": {"prometheus.io/port": "1"}},
     lambda d: d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"], "8000"),
    ({"podLabels": {"tier": "gpu"}}, lambda d: d["spec"]["template"]["metadata"]["labels"]["tier"], "gpu"),
    ({"resources": {"shmSize": "16Gi"}}, lambda d: _pod(d)["volumes"][1],
     {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}),
    ({"resources": {"gpus": 1, "gpuResourceName": "nvidia.com/mig-3g.40gb"}},
     lambda d: _c(d)["resources"]["limits"], {"nvidia.com/mig-3g.40gb": 1}),
    ({"resources": {"gpus": 1, "gpuResourceName": "amd.com/gpu"}},
     lambda d: _c(d)["resources"]["requests"], {"amd.com/gpu": 1}),
    ({"priorityClassName": "high"}, lambda d: _pod(d)["priorityClassName"], "high"),
    # rollout
    ({}, lambda d: d["spec"]["strategy"], {"type": "RollingUpdate",
                                           "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}),
    ({"rollout": {"strategy": "Recreate"}}, lambda d: d["spec"]["strategy"], {"type": "Recreate"}),
    ({"rollout": {"maxSurge": "25%", "maxUnavailable": 1}}, lambda d: d["spec"]["strategy"]["rollingUpdate"],
     {"maxSurge": "25%", "maxUnavailable": 1}),
    # tensor parallelism
    ({"resources": {"gpus": 4}}, lambda d: _arg(d, "--tensor-parallel-size"), "4"),
    ({"resources": {"gpus": 1}}, lambda d: _arg(d, "--tensor-parallel-size"), None),
    ({"resources": {"gpus": 2}, "engine": {"tensorParallelSize": 2}}, lambda d: _arg(d, "--tensor-parallel-size"),
     "2"),
    ({"resources": {"gpus": 0}, "engine": {"tensorParallelSize": 2}}, lambda d: _arg(d, "--tensor-parallel-size"),
     "2"),
    ({"resources": {"gpus": 4}}, lambda d: _pod(d)["volumes"][1]["emptyDir"]["medium"], "Memory"),
    # admin credential
    ({}, lambda d: _env(d, "INFLIGHT_ADMIN_API_KEY"),
     {"name": "INFLIGHT_ADMIN_API_KEY", "valueFrom": {"secretKeyRef": {"name": "demo-admin", "key": "admin-api-key"}}}),
]


@pytest.mark.parametrize(("overrides", "getter", "expected"), CASES)
def test_new_deployment_fields(overrides: dict[str, Any], getter: Any, expected: Any) -> None:
    assert getter(_deploy(overrides)) == expected


INVALID = [
    ({"model": {"hf": {}}}, "spec.model.hf.repoId is required"),
    ({"model": {"hf": {"repoId": "a b"}}}, "spec.model.hf.repoId 'a b' is not valid"),
    ({"model": {"hf": {"repoId": "a/b", "revision": "../x"}}}, "must not contain '..'"),
    ({"model": {"hf": {"repoId": "a/b", "allowPatterns": []}}}, "allowPatterns must be a non-empty list"),
    ({"model": {"hf": {"repoId": "a/b", "endpoint": "mirror.local"}}}, "endpoint must be an http(s) URL"),
    ({"model": {"pvc": {"claimName": "m"}, "cache": {"size": "1Gi"}}}, "cache is only used with spec.model.hf"),
    ({"model": {"hf": {"repoId": "a/b"}, "cache": {"claimName": "c", "size": "1Gi"}}}, "not both"),
    ({"model": {"hf": {"repoId": "a/b"}, "cache": {"size": "lots"}}}, "spec.model.cache.size 'lots' is not valid"),
    ({"model": {"hf": {"repoId": "a/b"}, "cache": {"size": "1Gi", "accessMode": "RWX"}}}, "accessMode must be"),
    ({"model": {"hostPath": {"path": "relative"}}}, "must be an absolute path"),
    ({"imagePullSecrets": ["regcred"]}, "spec.imagePullSecrets must be a list of objects"),
    ({"env": [{"name": "INFLIGHT_API_KEY", "value": "x"}]}, "is set by the operator"),
    ({"env": [{"name": "INFLIGHT_LIVE_MAX_QUEUE_LEN", "value": "1"}]}, "is set by the operator"),
    ({"env": [{"name": "A", "value": 1}]}, "spec.env[0].value must be a string"),
    ({"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "has 'A' twice"),
    ({"env": [{"name": "1 bad"}]}, "spec.env[0].name '1 bad' is not valid"),
    ({"envFrom": [{"prefix": "X_"}]}, "needs exactly one of configMapRef, secretRef"),
    ({"volumes": [{"name": "model", "emptyDir": {}}]}, "is used by the operator"),
    ({"volumes": [{"name": "Bad_Name"}]}, "spec.volumes[0].name 'Bad_Name' is not valid"),
    ({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, "is not in spec.volumes"),
    ({"volumes": VOLUMES, "volumeMounts": [{"name": "scratch", "mountPath": "/models/x"}]}, "operator's mounts"),
    ({"volumes": VOLUMES, "volumeMounts": [{"name": "scratch", "mountPath": "/dev/shm"}]}, "operator's mounts"),
    ({"runtimeClassName": "Nvidia!"}, "spec.runtimeClassName 'Nvidia!' is not valid"),
    ({"podLabels": {"app.kubernetes.io/instance": "x"}}, "must not set app.kubernetes.io/instance"),
    ({"podAnnotations": {"a": 1}}, "spec.podAnnotations values must be strings"),
    ({"resources": {"shmSize": "big"}}, "spec.resources.shmSize 'big' is not valid"),
    ({"resources": {"gpuResourceName": "gpu"}}, "spec.resources.gpuResourceName 'gpu' is not valid"),
    ({"rollout": {"strategy": "BlueGreen"}}, "spec.rollout.strategy must be one of"),
    ({"rollout": {"strategy": "Recreate", "maxSurge": 1}}, "apply to RollingUpdate only"),
    ({"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}, "cannot both be 0"),
    ({"rollout": {"maxSurge": "lots"}}, "spec.rollout.maxSurge must be an integer >= 0 or a percentage"),
    ({"resources": {"gpus": 2}, "engine": {"tensorParallelSize": 4}}, "must equal spec.resources.gpus (2)"),
    ({"engine": {"tensorParallelSize": 0}}, "tensor_parallel_size"),
    ({"engine": {"maxModelLen": 8192, "enableChunkedContext": False}}, "maxNumTokens (2048) is below maxModelLen"),
    ({"engine": {"maxModelLen": 8192, "maxNumTokens": 4096, "enableChunkedContext": False}}, "below maxModelLen"),
    ({"inferencePool": {"enabled": "yes"}}, "spec.inferencePool.enabled must be true or false"),
    ({"inferencePool": {"endpointPicker": {"failureMode": "Retry"}}}, "failureMode must be one of"),
    ({"inferencePool": {"endpointPicker": {"create": False}}}, "serviceName is required with create: false"),
    ({"inferencePool": {"endpointPicker": {"serviceName": "x"}}}, "set create: false with it"),
]


@pytest.mark.parametrize(("overrides", "message"), INVALID)
def test_invalid_new_fields_raise_actionable_errors(overrides: dict[str, Any], message: str) -> None:
    raw = copy.deepcopy(overrides)
    with pytest.raises(ValueError) as info:
        make_spec(raw)
    assert message in str(info.value)


def test_chunked_context_rule_accepts_enough_tokens() -> None:
    spec = make_spec({"engine": {"maxModelLen": 4096, "maxNumTokens": 4096, "enableChunkedContext": False}})
    assert spec.engine["max_num_tokens"] == 4096


KITCHEN_SINK: dict[str, Any] = {
    "model": {"servedModelName": "qwen", "hf": {"repoId": "Qwen/Qwen2.5-7B-Instruct", "revision": "main",
                                                  "tokenSecretRef": {"name": "hf", "key": "token"}},
              "cache": {"size": "100Gi", "storageClassName": "fast-rwx"}},
    "resources": {"gpus": 2, "memory": "64Gi", "shmSize": "8Gi", "gpuResourceName": "nvidia.com/gpu"},
    "imagePullSecrets": [{"name": "regcred"}],
    "env": ENV, "envFrom": [{"configMapRef": {"name": "extra"}}],
    "volumes": VOLUMES, "volumeMounts": MOUNTS,
    "runtimeClassName": "nvidia", "podAnnotations": {"team": "llm"}, "podLabels": {"tier": "gpu"},
    "priorityClassName": "high", "rollout": {"strategy": "Recreate"},
    "apiKeySecretRef": {"name": "api"},
    "inferencePool": {"enabled": True, "endpointPicker": {"serviceAccountName": "demo-epp"}},
}


def _all_objects(spec: Any) -> list[dict[str, Any]]:
    objects = [
        render.render_deployment(spec, OWNER, render.initial_replicas(spec)),
        render.render_service(spec, OWNER),
        render.render_pdb(spec, OWNER),
        render.render_configmap(spec, OWNER),
        render.render_admin_secret(spec, OWNER, "k" * 43),
        *render.render_pool_objects(spec, OWNER),
    ]
    if (pvc := render.render_cache_pvc(spec, OWNER)) is not None:
        objects.append(pvc)
    return objects


@pytest.mark.parametrize("case", ["kitchen-sink", *[p.stem for p in EXAMPLES]])
def test_every_rendered_object_is_valid_kubernetes(case: str) -> None:
    if case == "kitchen-sink":
        spec = make_spec(KITCHEN_SINK)
    else:
        doc = load_example(next(p for p in EXAMPLES if p.stem == case))
        spec = make_spec(doc["spec"], name=doc["metadata"]["name"])
    for obj in _all_objects(spec):
        if obj["kind"] == "InferencePool":
            _validate_pool(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _no_unknown_fields(value: Any, schema: dict[str, Any], where: str = "spec") -> None:
    """Structural schemas prune unknown fields silently; a rendered typo must fail here instead."""
    if isinstance(value, dict) and "properties" in schema:
        unknown = set(value) - set(schema["properties"])
        assert not unknown, f"{where}: fields not in the InferencePool CRD: {unknown}"
        for key, sub in value.items():
            _no_unknown_fields(sub, schema["properties"][key], f"{where}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _no_unknown_fields(item, schema["items"], f"{where}[{i}]")


def _validate_pool(pool: dict[str, Any]) -> None:
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    jsonschema.Draft4Validator(POOL_SCHEMA).validate(pool["spec"])
    _no_unknown_fields(pool["spec"], POOL_SCHEMA)
    ref = pool["spec"]["endpointPickerRef"]
    # The CRD's two CEL rules, evaluated by hand.
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert len(numbers) == len(set(numbers))


def test_inference_pool_selects_the_runtime_pods_and_names_its_picker() -> None:
    spec = make_spec(KITCHEN_SINK)
    pool, epp, svc = render.render_pool_objects(spec, OWNER)
    deploy = render.render_deployment(spec, OWNER, 1)
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": _c(deploy)["ports"][0]["containerPort"]}]
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "demo-epp", "port": {"number": 9002},
                                                 "failureMode": "FailClose"}
    assert svc["metadata"]["name"] == "demo-epp" and svc["spec"]["ports"][0]["port"] == 9002
    assert svc["spec"]["selector"] == epp["spec"]["template"]["metadata"]["labels"]
    assert not set(epp["spec"]["template"]["metadata"]["labels"].items()) <= set(pod_labels.items())
    args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    named = dict(zip(args[::2], args[1::2], strict=True))
    assert named["--pool-name"] == "demo" and named["--pool-namespace"] == "ns1"
    assert epp["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0"
    # The picker reads our metric names (docs/metrics.md), not vLLM's defaults: llm-d's router picker
    # refuses the old flags and takes them as its metrics extractor's default engine.
    assert not [a for a in args if a.endswith("-metric")]
    config = yaml.safe_load(named["--config-text"])
    (extractor,) = [p["parameters"] for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["engineConfigs"]
    assert extractor["defaultEngine"] == engine["name"]
    assert (engine["queuedRequestsSpec"], engine["runningRequestsSpec"], engine["kvUsageSpec"]) == (
        "inflight:num_requests_waiting", "inflight:num_requests_running", "inflight:kv_cache_usage_perc")
    refs = {p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]}
    assert refs <= {p["type"] for p in config["plugins"]}
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == "demo-epp"
    # GIE's picker image still gets the flags.
    gie = make_spec({"inferencePool": {"enabled": True, "endpointPicker": {
        "image": "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.0"}}})
    flags = render_pool.picker_args(gie)
    assert flags[flags.index("--total-queued-requests-metric") + 1] == "inflight:num_requests_waiting"
    assert flags[flags.index("--kv-cache-usage-percentage-metric") + 1] == "inflight:kv_cache_usage_perc"
    assert "--config-text" not in flags


def test_metric_names_given_to_the_picker_exist_in_the_runtime() -> None:
    metrics_doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for name in (render_pool.QUEUE_METRIC, render_pool.RUNNING_METRIC, render_pool.KV_METRIC):
        assert name in metrics_doc


def test_existing_picker_renders_only_the_pool() -> None:
    spec = make_spec({"inferencePool": {"enabled": True, "endpointPicker": {"create": False, "serviceName": "gw-epp",
                                                                             "failureMode": "FailOpen"}}})
    (pool,) = render.render_pool_objects(spec, OWNER)
    assert pool["spec"]["endpointPickerRef"]["name"] == "gw-epp"
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert render.render_pool_objects(make_spec({}), OWNER) == []


def test_admin_secret_holds_the_key_base64_and_is_owned() -> None:
    secret = render.render_admin_secret(make_spec({}), OWNER, "abc")
    assert secret["metadata"]["name"] == "demo-admin"
    assert base64.b64decode(secret["data"]["admin-api-key"]) == b"abc"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid


def test_recreate_patch_clears_rolling_update_and_optional_pod_keys() -> None:
    deploy = _deploy({"rollout": {"strategy": "Recreate"}})
    patch = render.deployment_patch(deploy, autoscaling=False)
    assert patch["spec"]["strategy"] == {"type": "Recreate", "rollingUpdate": None}
    assert patch["spec"]["template"]["spec"]["imagePullSecrets"] is None
    assert patch["spec"]["template"]["spec"]["runtimeClassName"] is None


@pytest.mark.parametrize(
    ("change", "rolls"),
    [
        ({"env": ENV}, True),
        ({"rollout": {"strategy": "Recreate"}}, False),  # the strategy is not part of the template
        ({"resources": {"shmSize": "1Gi"}}, True),
        ({"engine": {"maxNumTokens": 999}}, False),
    ],
)
def test_template_changes(change: dict[str, Any], rolls: bool) -> None:
    before = _deploy({})["spec"]["template"]
    assert (before != _deploy(change)["spec"]["template"]) is rolls
