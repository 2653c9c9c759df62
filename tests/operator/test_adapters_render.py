"""spec.adapters (issue 49): parsing and its refusals, the CRD schema, the pod template (volumes,
init containers, readiness gate), the picker's LoRA metric, and the rule that a pvc adapter added
on a claim already mounted leaves the pod template (so the ReplicaSet) unchanged."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from inflight.operator import engine_args, render, render_pool
from inflight.operator.adapter_source import adapter_path
from inflight.operator.render import Owner
from inflight.operator.render_adapters import READINESS_GATE
from tests.operator.helpers import CRD_PATH, make_spec
from tests.operator.test_spec_and_crd import K8S_VERSION

OWNER = Owner(name="demo", uid="0b7c4e1e-0000-4000-8000-000000000001")
HF_MODEL = {"model": {"hf": {"repoId": "org/base"}, "cache": {"claimName": "cache"}}}


def _pvc(name: str, path: str, claim: str = "loras") -> dict[str, Any]:
    return {"name": name, "source": {"pvc": {"claimName": claim, "path": path}}}


def _hf(name: str, repo: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "source": {"hf": {"repo": repo, **extra}}}


def _template(overrides: dict[str, Any]) -> dict[str, Any]:
    spec = make_spec(overrides)
    return render.render_deployment(spec, OWNER, 1)["spec"]["template"]


def test_adapters_parse_and_turn_lora_on() -> None:
    spec = make_spec({"adapters": [_pvc("sql", "/sql/"), _hf("chat", "org/chat-lora", revision="v2",
                                                           tokenSecret={"name": "hf"})]})
    sql, chat = spec.adapters
    assert sql.pvc is not None and (sql.pvc.claim_name, sql.pvc.path) == ("loras", "sql")
    assert chat.hf is not None and (chat.hf.repo, chat.hf.revision) == ("org/chat-lora", "v2")
    assert chat.hf.token is not None and (chat.hf.token.name, chat.hf.token.key) == ("hf", "token")
    assert spec.engine["enable_lora"] is True
    assert "--enable-lora" in engine_args.static_flags(spec.engine)
    assert adapter_path(sql, spec.model) == "/adapters/pvc/loras/sql"
    assert adapter_path(chat, spec.model) == "/adapters/local/hf/org--chat-lora/v2"


def test_hf_adapters_land_in_the_models_shared_cache() -> None:
    spec = make_spec({**HF_MODEL, "adapters": [_hf("chat", "org/chat-lora")]})
    assert adapter_path(spec.adapters[0], spec.model) == "/models/adapters/hf/org--chat-lora/main"
    pod = render.render_pod_template(spec)["spec"]
    fetch = [c for c in pod["initContainers"] if c["name"] == "adapter-chat"][0]
    assert fetch["command"][:3] == ["python", "-m", "inflight.operator.model_fetch"]
    assert fetch["command"][fetch["command"].index("--dest") + 1] == "/models/adapters/hf/org--chat-lora/main"
    assert fetch["command"][fetch["command"].index("--expect-file") + 1] == "adapter_config.json"
    assert {"name": "model", "mountPath": "/models"} in fetch["volumeMounts"]
    assert [c["name"] for c in pod["initContainers"]] == ["model-fetch", "adapter-chat"]  # the model first
    assert "adapters-local" not in {v["name"] for v in pod["volumes"]}  # nothing per pod


@pytest.mark.parametrize(("adapters", "engine", "message"), [
    ([_pvc("Bad_Name", "x")], {}, "spec.adapters[0].name"),
    ([_pvc("a", "x"), _pvc("a", "y")], {}, "used twice"),
    ([_pvc("demo", "x")], {}, "base model's served name"),
    ([{"name": "a", "source": {}}], {}, "exactly one of hf, pvc, image"),
    ([{"name": "a", "source": {"pvc": {"claimName": "c"}, "hf": {"repo": "o/r"}}}], {}, "exactly one"),
    ([{"name": "a"}], {}, "spec.adapters[0].source is required"),
    ([_pvc("a", "../etc")], {}, "without '..'"),
    ([_hf("a", "not a repo")], {}, "spec.adapters[0].source.hf.repo"),
    ([{"name": "a", "source": {"image": {"reference": "r/a:1", "path": "rel"}}}], {}, "absolute"),
    ([_pvc("a", "x")], {"enableLora": False}, "enableLora is false"),
    ([_pvc("a", "x")], {"maxLoras": 4, "maxCpuLoras": 2}, "max_cpu_loras"),
    ("sql", {}, "must be a list"),
])
def test_bad_adapters_are_refused_with_the_field(adapters: Any, engine: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=None) as exc:
        make_spec({"adapters": adapters, "engine": engine})
    assert message in str(exc.value)


def test_adapter_mounts_and_volumes_are_reserved_with_lora() -> None:
    volumes = {"volumes": [{"name": "adapters-x", "emptyDir": {}}]}
    with pytest.raises(ValueError, match="adapters-\\* are the operator's"):
        make_spec({**volumes, "adapters": [_pvc("a", "x")]})
    make_spec(volumes)  # without LoRA the names are free
    mounts = {"volumes": [{"name": "scratch", "emptyDir": {}}],
              "volumeMounts": [{"name": "scratch", "mountPath": "/adapters/mine"}]}
    with pytest.raises(ValueError, match="inside /adapters"):
        make_spec({**mounts, "engine": {"enableLora": True}})


def test_the_pod_template_carries_the_gate_and_the_sources_not_the_list() -> None:
    template = _template({"adapters": [_pvc("sql", "sql"),
                                       {"name": "img", "source": {"image": {"reference": "r/img:1",
                                                                            "path": "/lora"}}}]})
    pod = template["spec"]
    assert pod["readinessGates"] == [{"conditionType": READINESS_GATE}]
    args = pod["containers"][0]["args"]
    assert "--enable-lora" in args and "--lora-modules" not in args
    mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["/adapters/pvc/loras"]["readOnly"] and mounts["/adapters/local"]["readOnly"]
    claims = [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert {"claimName": "loras", "readOnly": True} in claims
    (copy,) = [c for c in pod["initContainers"] if c["name"] == "adapter-img"]
    assert copy["image"] == "r/img:1" and "/adapters/local/image/img" in copy["command"][2]
    kubernetes_validate.validate(render.render_deployment(make_spec({"adapters": [_pvc("sql", "sql")]}), OWNER, 1),
                                 K8S_VERSION, strict=True)


def test_adding_or_removing_an_adapter_on_a_mounted_claim_keeps_the_template() -> None:
    one = _template({"adapters": [_pvc("sql", "sql")]})
    two = _template({"adapters": [_pvc("sql", "sql"), _pvc("chat", "chat")]})
    enabled = _template({"engine": {"enableLora": True}})
    assert json.dumps(one, sort_keys=True) == json.dumps(two, sort_keys=True)
    # enableLora alone: the gate is there already, so the first adapter only adds its claim's volume
    assert enabled["spec"]["readinessGates"] == one["spec"]["readinessGates"]
    assert "readinessGates" not in _template({})["spec"]


def test_no_gate_without_lora_and_the_patch_clears_it() -> None:
    spec = make_spec({})
    patch = render.deployment_patch(render.render_deployment(spec, OWNER, 1), autoscaling=False)
    assert patch["spec"]["template"]["spec"]["readinessGates"] is None


def test_picker_reads_the_lora_metric_only_with_lora() -> None:
    gie = {"inferencePool": {"enabled": True, "endpointPicker": {"image": "registry.k8s.io/gateway-api-inference-"
                                                                          "extension/epp:v1.0.0"}}}
    on = render_pool.picker_args(make_spec({**gie, "adapters": [_pvc("sql", "sql")]}))
    off = render_pool.picker_args(make_spec(gie))
    assert on[on.index("--lora-info-metric") + 1] == "vllm:lora_requests_info"
    assert off[off.index("--lora-info-metric") + 1] == ""

    def router_lora(spec: Any) -> str:  # llm-d's router picker: in its config's engine, not a flag
        args = render_pool.picker_args(spec)
        assert "--lora-info-metric" not in args
        config = yaml.safe_load(args[args.index("--config-text") + 1])
        (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
        return extractor["parameters"]["engineConfigs"][0]["loraSpec"]

    router = {"inferencePool": {"enabled": True}}
    assert router_lora(make_spec({**router, "adapters": [_pvc("sql", "sql")]})) == "vllm:lora_requests_info"
    assert router_lora(make_spec(router)) == ""


def _schema() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_schema_takes_adapters_and_refuses_bad_ones() -> None:
    validator = jsonschema.Draft4Validator(_schema())
    doc = {"apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "x"},
           "spec": {"model": {"hostPath": {"path": "/m"}}, "engine": {"maxLoras": 4, "maxLoraRank": 64},
                    "adapters": [_pvc("sql", "sql"), _hf("chat", "org/chat")]}}
    validator.validate(doc)
    doc["spec"]["adapters"] = [{"name": "Upper_Case", "source": {"pvc": {"claimName": "c"}}}]
    assert list(validator.iter_errors(doc))
    doc["spec"]["adapters"] = [{"name": "a"}]  # no source
    assert list(validator.iter_errors(doc))
    props = _schema()["properties"]["spec"]["properties"]["adapters"]
    assert props["x-kubernetes-list-map-keys"] == ["name"]
    rule = props["items"]["properties"]["source"]["x-kubernetes-validations"][0]["rule"]
    assert "has(self.hf), has(self.pvc), has(self.image)" in rule
    status = _schema()["properties"]["status"]["properties"]["adapters"]["items"]["properties"]
    assert set(status) == {"name", "loadedPods", "totalPods", "lastError"}


def test_the_docs_manifest_is_accepted() -> None:
    text = (CRD_PATH.parents[1] / "docs" / "operator-adapters.md").read_text()
    doc = yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    jsonschema.Draft4Validator(_schema()).validate(doc)
    spec = make_spec(doc["spec"])
    assert [a.name for a in spec.adapters] == ["sql", "support", "legal"]
    assert adapter_path(spec.adapters[1], spec.model) == "/models/adapters/hf/my-org--support-lora/3f2a9c1"
    pod = render.render_pod_template(spec)["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["model-fetch", "adapter-support", "adapter-legal"]
    kubernetes_validate.validate(render.render_deployment(spec, OWNER, 1), K8S_VERSION, strict=True)
