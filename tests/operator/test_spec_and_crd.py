"""Spec parsing/validation, the engine-field mapping, the CRD file and schema validation."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from inflight.operator import crd, engine_args, render
from inflight.operator.render import Owner
from inflight.operator.spec import parse_spec
from inflight.runtime.config import LIVE_TUNABLE_FIELDS, EngineConfig
from tests.operator.helpers import CRD_PATH, EXAMPLES, load_example, make_spec

K8S_VERSION = "1.30.0"


def _openapi_schema() -> dict[str, Any]:
    doc = yaml.safe_load(CRD_PATH.read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_file_is_generated_from_code() -> None:
    assert yaml.safe_load(CRD_PATH.read_text()) == crd.build_crd(), (
        "crds/ is stale: run `python -m inflight.operator.crd > crds/inflight.dev_inferencedeployments.yaml`"
    )


def test_crd_engine_properties_are_exactly_the_engine_knobs() -> None:
    engine_props = set(_openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"])
    expected = {engine_args.snake_to_camel(n) for n in engine_args.CR_ENGINE_FIELDS} | {"extraArgs"}
    assert engine_props == expected
    issue_list = {"maxNumSequences", "maxNumTokens", "kvCacheFreeGpuMemFraction", "blockSize",
                  "enableChunkedContext", "enablePrefixCaching", "maxModelLen", "dtype",
                  "schedulerPolicy", "maxQueueLen", "tensorParallelSize", "pipelineParallelSize",
                  "enforceEager", "asyncScheduling", "quantization", "speculativeConfig", "maxTokensInPagedKvCache",
                  "enableLora", "maxLoras", "maxLoraRank", "maxCpuLoras", "kvCacheDtype", "calculateKvScales",
                  "kvOffloadingSize"}
    assert engine_props - {"extraArgs"} == issue_list


def test_every_engine_config_field_is_exposed_or_excluded_with_a_reason() -> None:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(engine_args.CR_ENGINE_FIELDS) | set(engine_args.EXCLUDED_ENGINE_FIELDS) == names
    assert not set(engine_args.CR_ENGINE_FIELDS) & set(engine_args.EXCLUDED_ENGINE_FIELDS)
    assert set(LIVE_TUNABLE_FIELDS) <= set(engine_args.CR_ENGINE_FIELDS)


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(EngineConfig)])
def test_camel_case_round_trip(name: str) -> None:
    assert engine_args.camel_to_snake(engine_args.snake_to_camel(name)) == name


def test_crd_and_scale_subresource() -> None:
    doc = crd.build_crd()
    version = doc["spec"]["versions"][0]
    assert doc["spec"]["names"]["shortNames"] == ["infd"]
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    assert {c["name"] for c in version["additionalPrinterColumns"]} == {"Model", "Ready", "Desired", "KV", "Queue", "Age"}
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_against_crd_schema(path: pathlib.Path) -> None:
    doc = load_example(path)
    jsonschema.Draft4Validator(_openapi_schema()).validate(doc)
    parse_spec(doc["metadata"]["name"], doc["metadata"]["namespace"], doc["spec"])


def test_three_examples_exist() -> None:
    assert {p.stem for p in EXAMPLES} >= {"minimal", "tuned", "autoscaled"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_rendered_objects_validate_against_kubernetes(path: pathlib.Path) -> None:
    doc = load_example(path)
    spec = parse_spec(doc["metadata"]["name"], doc["metadata"]["namespace"], doc["spec"])
    owner = Owner(name=spec.name, uid="0b7c4e1e-0000-4000-8000-000000000001")
    objects = [
        render.render_deployment(spec, owner, render.initial_replicas(spec)),
        render.render_service(spec, owner),
        render.render_pdb(spec, owner),
        render.render_configmap(spec, owner),
    ]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("bad_example_change", "schema_path_word"),
    [
        ({"engine": {"dtype": "int4"}}, "dtype"),
        ({"engine": {"maxNumSequences": 0}}, "maxNumSequences"),
        ({"engine": {"bogus": 1}}, None),  # structural schemas prune unknown fields; parse_spec rejects
        ({"autoscaling": {"targetKvCacheUsage": 1.5}}, "targetKvCacheUsage"),
        ({"engine": {"maxNumSequences": 2**31}}, "maxNumSequences"),  # the runtime's MAX_CONFIG_INT + 1
        ({"engine": {"maxModelLen": 2**31}}, "maxModelLen"),
        ({"metricsApiKeySecretRef": {}}, "metricsApiKeySecretRef"),
        ({"metricsApiKeySecretRef": {"name": 7}}, "metricsApiKeySecretRef"),
    ],
)
def test_schema_rejects_bad_values(bad_example_change: dict[str, Any], schema_path_word: str | None) -> None:
    doc = {"apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "x"}, "spec": {"model": {"hostPath": {"path": "/m"}}, **bad_example_change}}
    errors = list(jsonschema.Draft4Validator(_openapi_schema()).iter_errors(doc))
    if schema_path_word is not None:
        assert any(schema_path_word in "/".join(map(str, e.absolute_path)) for e in errors)
    with pytest.raises(ValueError):
        parse_spec("x", "ns", doc["spec"])


INVALID_SPECS = [
    ({"model": {}}, "exactly one of pvc, hostPath, image"),
    ({"model": {"pvc": {"claimName": "a"}, "hostPath": {"path": "/x"}}}, "exactly one"),
    ({"model": {"pvc": {}}}, "spec.model.pvc.claimName is required"),
    ({"engine": {"maxNumSequences": -1}}, "max_num_sequences must be an integer >= 1"),
    ({"engine": {"dtype": "fp8"}}, "dtype must be one of"),
    ({"engine": {"blockSize": 12}}, "power of two"),
    ({"engine": {"maxNumSequence": 4}}, "unknown field(s) maxNumSequence"),
    ({"engine": {"extraArgs": "--x"}}, "extraArgs must be a list of strings"),
    ({"replicas": -1}, "spec.replicas must be an integer >= 0"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas (5) must not exceed maxReplicas (2)"),
    ({"autoscaling": {"minReplicas": -1}}, "minReplicas must be an integer >= 0"),
    ({"autoscaling": {"targetQueueDepth": 0}}, "targetQueueDepth must be a number > 0"),
    ({"autoscaling": {"targetKvCacheUsage": 1.2}}, "targetKvCacheUsage must be in (0, 1]"),
    ({"service": {"type": "Headless"}}, "spec.service.type must be one of"),
    ({"service": {"port": 70000}}, "port must be <= 65535"),
    ({"apiKeySecretRef": {}}, "spec.apiKeySecretRef.name is required"),
    ({"metricsApiKeySecretRef": {}}, "spec.metricsApiKeySecretRef.name is required"),
    ({"metricsApiKeySecretRef": "prom"}, "spec.metricsApiKeySecretRef must be an object"),
    ({"metricsApiKeySecretRef": {"name": "Prom_Token"}}, "spec.metricsApiKeySecretRef.name 'Prom_Token' is not valid"),
    ({"metricsApiKeySecretRef": {"name": "prom", "key": "a/b"}}, "spec.metricsApiKeySecretRef.key 'a/b' is not valid"),
    ({"apiKeySecretRef": {"name": "s", "key": "k"}, "metricsApiKeySecretRef": {"name": "s", "key": "k"}},
     "same Secret entry as spec.apiKeySecretRef"),
    ({"metricsApiKeySecretRef": {"name": "prom"}, "engine": {"extraArgs": ["--metrics-api-key=x"]}},
     "both set the metrics key"),
    ({"metricsApiKeySecretRef": {"name": "prom"}, "env": [{"name": "INFLIGHT_METRICS_API_KEY", "value": "x"}]},
     "both set the metrics key"),
    ({"metricsApiKeySecretRef": {"name": "prom"}, "inferencePool": {"enabled": True}},
     "close /metrics to the InferencePool's endpoint picker"),
    ({"tolerations": {"key": "x"}}, "spec.tolerations must be a list of objects"),
    # Checked as the pod will run: gpus fills in tensorParallelSize, which these options refuse.
    ({"engine": {"speculativeConfig": {"method": "draft_model", "model": "/models/d", "num_speculative_tokens": 3}},
      "resources": {"gpus": 4}}, "draft_model needs tensor_parallel_size 1"),
    # A ReadWriteOnce cache PVC attaches to one node: a second replica would hang on Multi-Attach.
    ({"model": {"hf": {"repoId": "org/m"}, "cache": {"size": "20Gi"}}, "replicas": 2},
     "accessMode is ReadWriteOnce but spec.replicas is 2"),
    ({"model": {"hf": {"repoId": "org/m"}, "cache": {"size": "20Gi", "accessMode": "ReadWriteOncePod"}},
      "autoscaling": {"enabled": True, "maxReplicas": 3}}, "accessMode is ReadWriteOncePod but spec.autoscaling"),
]


@pytest.mark.parametrize("overrides", [
    {"engine": {"asyncScheduling": True}, "resources": {"gpus": 1}},
    {"engine": {"asyncScheduling": True}, "resources": {"gpus": 0}},
    {"engine": {"asyncScheduling": True}, "resources": {"gpus": 2}},  # with tensor parallelism too
    {"model": {"hf": {"repoId": "org/m"}, "cache": {"size": "20Gi"}}, "replicas": 1,
     "autoscaling": {"enabled": False, "maxReplicas": 4}},
    {"model": {"hf": {"repoId": "org/m"}, "cache": {"size": "20Gi", "storageClassName": "nfs"}}, "replicas": 3},
    {"model": {"hf": {"repoId": "org/m"}, "cache": {"claimName": "shared"}}, "replicas": 3},
])
def test_specs_that_run_as_written_are_accepted(overrides: dict[str, Any]) -> None:
    make_spec(overrides)


@pytest.mark.parametrize(("overrides", "message"), INVALID_SPECS)
def test_invalid_spec_raises_actionable_value_error(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        make_spec(overrides)
    assert message in str(info.value)


def test_crd_engine_integers_stop_where_the_runtime_does() -> None:
    """The runtime refuses integers above MAX_CONFIG_INT; the CRD says so, so the API server
    refuses them at apply time instead of the pod failing at start."""
    from inflight.runtime.config import MAX_CONFIG_INT

    engine = _openapi_schema()["properties"]["spec"]["properties"]["engine"]["properties"]
    integers = {k: v for k, v in engine.items() if v.get("type") == "integer"}
    assert {"maxNumSequences", "maxNumTokens", "maxModelLen", "maxQueueLen"} <= set(integers)
    assert {k: v.get("maximum") for k, v in integers.items()} == dict.fromkeys(integers, MAX_CONFIG_INT)
    make_spec({"engine": {"maxNumTokens": MAX_CONFIG_INT}})  # the ceiling itself is fine


def test_metrics_key_ref_parses_with_the_crds_default_key() -> None:
    from inflight.operator.spec import METRICS_KEY_ENV, MetricsKeyRef
    from inflight.runtime.cli.command import METRICS_API_KEY_ENV

    assert METRICS_KEY_ENV == METRICS_API_KEY_ENV  # the env var the runtime reads
    assert make_spec({"metricsApiKeySecretRef": {"name": "prom"}}).metrics_api_key_secret_ref == MetricsKeyRef("prom")
    assert make_spec({}).metrics_api_key_secret_ref is None
    prop = _openapi_schema()["properties"]["spec"]["properties"]["metricsApiKeySecretRef"]
    assert prop["required"] == ["name"] and prop["properties"]["key"]["default"] == MetricsKeyRef("x").key


def test_missing_model_is_reported() -> None:
    with pytest.raises(ValueError, match="spec.model is required"):
        parse_spec("x", "ns", {})


def test_engine_values_keep_only_what_was_set() -> None:
    spec = make_spec({"engine": {"maxNumSequences": 8, "dtype": "bfloat16"}})
    assert spec.engine == {"max_num_sequences": 8, "dtype": "bfloat16"}
    assert engine_args.live_values(spec.engine)["max_num_tokens"] == EngineConfig().max_num_tokens
