"""The chart loads, lints and renders with Helm's library for every values case, and every
rendered object validates against the Kubernetes schemas (kubernetes-validate)."""

from __future__ import annotations

from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from chart_support import (
    CHART_DIR,
    RELEASE_NAMESPACE,
    VALUES_CASES,
    WATCH_NAMESPACE,
    by_kind,
    load_values,
    one,
    parse_manifests,
)

CASES = list(VALUES_CASES)
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schemas.
KUBE_VERSIONS = ("1.25.0", "1.37.0")

# ServiceMonitor is a Prometheus Operator CRD type, not in the Kubernetes schemas: this is the
# part of monitoring.coreos.com/v1 that the chart uses, with its types and required fields.
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
SERVICE_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _LABELS},
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "authorization": {  # SafeAuthorization: a Secret in the monitor's namespace
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": {  # a SecretKeySelector
                                        "type": "object",
                                        "required": ["key"],
                                        "additionalProperties": False,
                                        "properties": {"name": {"type": "string"}, "key": {"type": "string"},
                                                       "optional": {"type": "boolean"}},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def test_chart_loads(chart: helm.Chart) -> None:
    assert chart.name == "inflight"
    assert chart.metadata["apiVersion"] == "v2"
    assert chart.schema is not None, "values.schema.json is missing"
    assert {t["name"] for t in chart.templates} >= {
        "templates/deployment.yaml",
        "templates/rbac.yaml",
        "templates/serviceaccount.yaml",
        "templates/servicemonitor.yaml",
        "templates/grafana-dashboard.yaml",
        "templates/NOTES.txt",
    }


@pytest.mark.parametrize("case", CASES)
def test_lint_is_clean(case: str) -> None:
    report = helm.lint(CHART_DIR, load_values(case), strict=True, kube_version="v1.30.0")
    assert report["errors"] == [], report
    assert report["messages"] == [], report


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_object_validates(objects, case: str, kube_version: str) -> None:
    objs = objects(case)
    assert objs, "nothing rendered"
    for obj in objs:
        where = f"{obj['kind']}/{obj['metadata']['name']} ({case}, Kubernetes {kube_version})"
        if obj["kind"] == "ServiceMonitor":
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{where}: {err.message} at {list(err.absolute_path)}")


def test_defaults_render_only_the_operator(objects) -> None:
    kinds = sorted(o["kind"] for o in objects("defaults"))
    # The second and third ClusterRole and the second ClusterRoleBinding: the endpoint pickers'
    # (rbac.picker, and pickerMetrics.auth: their TokenReview/SubjectAccessReview rights).
    assert kinds == ["ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding",
                     "Deployment", "Job", "Role", "RoleBinding", "Service", "ServiceAccount"]
    (service,) = by_kind(objects("defaults"), "Service")  # the operator's own metrics
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]


def test_all_on_renders_every_option(objects) -> None:
    kinds = {o["kind"] for o in objects("all-on")}
    assert {"ServiceMonitor", "ConfigMap"} <= kinds


@pytest.mark.parametrize("case", CASES)
def test_operator_deployment_shape(objects, case: str) -> None:
    deploy = one(objects(case), "Deployment")
    spec = deploy["spec"]
    assert deploy["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    port = next(p for p in container["ports"] if p["name"] == probe["port"])
    expected_port = load_values(case).get("operator", {}).get("livenessPort", 8080)
    assert port["containerPort"] == expected_port
    assert f"--liveness=http://0.0.0.0:{expected_port}/healthz" in container["args"]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["serviceAccountName"] == one(objects(case), "ServiceAccount")["metadata"]["name"]


@pytest.mark.parametrize("case", CASES)
def test_restricted_security_context(objects, case: str) -> None:
    pod = one(objects(case), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsUser"] != 0
    for container in pod["containers"]:
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["runAsNonRoot"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert "privileged" not in sc
    assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
    assert all("hostPath" not in v for v in pod.get("volumes", []))


@pytest.mark.parametrize(
    ("case", "scope_args"),
    [
        ("defaults", ["--all-namespaces"]),
        ("all-on", ["--all-namespaces"]),
        ("namespaced", [f"--namespace={WATCH_NAMESPACE}"]),
        ("all-on-namespaced", [f"--namespace={WATCH_NAMESPACE}"]),
    ],
)
def test_kopf_command_line(objects, case: str, scope_args: list[str]) -> None:
    (container,) = one(objects(case), "Deployment")["spec"]["template"]["spec"]["containers"]
    argv = container["command"] + container["args"]
    assert argv[:3] == ["kopf", "run", "--module=inflight.operator.kopf_main"]
    scope = [a for a in argv if a.startswith(("--namespace", "--all-namespaces", "-n", "-A"))]
    assert scope == scope_args


def test_all_on_passes_options_through(objects) -> None:
    objs = objects("all-on")
    pod = one(objs, "Deployment")["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert {"--log-format=json", "--debug", "--priority=100"} <= set(container["args"])
    assert {"name": "INFLIGHT_LOG_EXTRA", "value": "1"} in container["env"]
    assert pod["metadata"]["labels"]["team"] == "ml-platform"
    assert pod["metadata"]["annotations"] == {"example.com/owner": "sre"}
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["spec"]["tolerations"][0]["key"] == "dedicated"
    assert "nodeAffinity" in pod["spec"]["affinity"]
    sa = one(objs, "ServiceAccount")
    assert sa["metadata"]["name"] == "inflight-operator"
    assert "eks.amazonaws.com/role-arn" in sa["metadata"]["annotations"]


@pytest.mark.parametrize(
    ("case", "namespace_selector"),
    [("all-on", {"any": True}), ("all-on-namespaced", {"matchNames": [WATCH_NAMESPACE]})],
)
def test_service_monitor_selects_runtime_pods(objects, case: str, namespace_selector) -> None:
    monitor = _runtime_monitor(objects(case))
    assert monitor["metadata"]["namespace"] == "monitoring"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"] == {
        "matchLabels": {
            "app.kubernetes.io/name": "inflight-runtime",
            "app.kubernetes.io/managed-by": "inflight-operator",
        }
    }
    assert monitor["spec"]["namespaceSelector"] == namespace_selector
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")


@pytest.mark.parametrize(("authorization", "expected"), [
    (None, None),  # as before: no token
    ({"secretName": ""}, None),
    ({"secretName": "prom-token"}, {"type": "Bearer", "credentials": {"name": "prom-token", "key": "token"}}),
    ({"secretName": "prom-token", "key": "1234"},
     {"type": "Bearer", "credentials": {"name": "prom-token", "key": "1234"}}),  # a numeric-looking key stays a string
])
def test_service_monitor_sends_the_metrics_token(chart: helm.Chart, authorization: dict | None,
                                                  expected: dict | None) -> None:
    """Runtime pods with an apiKeySecretRef answer /metrics only with a key: the ServiceMonitor
    sends serviceMonitor.authorization's Secret as a bearer token (the operator's own metrics need none)."""
    monitor = {"enabled": True, **({"authorization": authorization} if authorization is not None else {})}
    rendered = chart.render({"serviceMonitor": monitor}, name="inflight", namespace=RELEASE_NAMESPACE, is_install=True)
    objs = parse_manifests(rendered)
    (endpoint,) = _runtime_monitor(objs)["spec"]["endpoints"]
    assert endpoint.get("authorization") == expected
    for obj in by_kind(objs, "ServiceMonitor"):
        jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
    (operator_endpoint,) = [m for m in by_kind(objs, "ServiceMonitor")
                            if m["metadata"]["name"].endswith("-operator")][0]["spec"]["endpoints"]
    assert "authorization" not in operator_endpoint
    notes = rendered["inflight/templates/NOTES.txt"]
    assert ("metricsApiKeySecretRef" in notes) and (("answer 401" in notes) is (expected is None))


def test_service_monitor_token_key_default_is_the_crds() -> None:
    """One token key name on both sides: the chart's default key is metricsApiKeySecretRef's."""
    from inflight.operator import crd

    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    spec = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    ref = spec["properties"]["metricsApiKeySecretRef"]["properties"]["key"]
    assert values["serviceMonitor"]["authorization"]["key"] == ref["default"]


def test_all_on_service_monitor_sends_the_token(objects) -> None:
    (endpoint,) = _runtime_monitor(objects("all-on"))["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer",
                                         "credentials": {"name": "inflight-metrics-token", "key": "token"}}


def test_operator_pods_are_not_selected_as_runtime_pods(objects) -> None:
    labels = one(objects("all-on"), "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] != "inflight-runtime"


def test_serviceaccount_can_be_external(chart: helm.Chart) -> None:
    values = {"serviceAccount": {"create": False, "name": "existing-sa"}}
    rendered = chart.render(values, name="inflight", namespace=RELEASE_NAMESPACE)
    objs = parse_manifests(rendered)
    assert by_kind(objs, "ServiceAccount") == []
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "existing-sa"
    binding = one(objs, "ClusterRoleBinding")
    assert binding["subjects"][0]["name"] == "existing-sa"


def test_rbac_can_be_left_to_the_user(chart: helm.Chart) -> None:
    objs = parse_manifests(chart.render({"rbac": {"create": False}}, name="inflight"))
    assert not {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} & {o["kind"] for o in objs}


def test_notes_render(render) -> None:
    notes = render("namespaced")["inflight/templates/NOTES.txt"]
    assert "kubectl get infd -n llm-serving" in notes
    assert "ghcr.io/inflight-dev/inflight-runtime:0.1.0" in notes


def test_service_monitor_matches_what_the_operator_renders(objects) -> None:
    """The ServiceMonitor's selector and port name select the Services the operator creates."""
    try:
        from inflight.operator.render import Owner, render_service
        from inflight.operator.spec import parse_spec
    except ImportError as err:
        pytest.fail(f"the operator's render/spec modules are missing ({err})")
    spec = parse_spec("llama", WATCH_NAMESPACE, {"model": {"pvc": {"claimName": "models"}}})
    service = render_service(spec, Owner(name="llama", uid="uid-1"))
    monitor = _runtime_monitor(objects("all-on"))["spec"]
    selector = monitor["selector"]["matchLabels"]
    labels = service["metadata"]["labels"]
    assert {k: labels.get(k) for k in selector} == selector
    assert monitor["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


def _runtime_monitor(objs: list[dict]) -> dict:
    (monitor,) = [m for m in by_kind(objs, "ServiceMonitor") if m["metadata"]["name"].endswith("-runtime")]
    return monitor


def test_operator_metrics_are_served_and_monitored(objects) -> None:
    objs = objects("all-on")
    container = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "INFLIGHT_OPERATOR_METRICS_PORT", "value": "9091"} in container["env"]
    assert {"name": "metrics", "containerPort": 9091, "protocol": "TCP"} in container["ports"]
    (service,) = by_kind(objs, "Service")
    (monitor,) = [m for m in by_kind(objs, "ServiceMonitor") if m["metadata"]["name"].endswith("-operator")]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert {k: service["metadata"]["labels"].get(k) for k in selector} == selector
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert {k: pod_labels.get(k) for k in service["spec"]["selector"]} == service["spec"]["selector"]


def test_network_policies_let_the_operator_reach_runtime_pods(objects) -> None:
    policies = by_kind(objects("all-on"), "NetworkPolicy")
    assert [p["metadata"]["namespace"] for p in policies] == ["llm-a", "llm-b"]
    rule = policies[0]["spec"]["ingress"][0]
    pod_labels = one(objects("all-on"), "Deployment")["spec"]["template"]["metadata"]["labels"]
    peer = rule["from"][0]["podSelector"]["matchLabels"]
    assert {k: pod_labels.get(k) for k in peer} == peer
    assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert policies[0]["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "inflight-runtime"
    assert by_kind(objects("defaults"), "NetworkPolicy") == []


def test_two_replicas_elect_a_leader_and_one_without_it_recreates(chart: helm.Chart) -> None:
    objs = parse_manifests(chart.render({"replicas": 2}, name="inflight", namespace=RELEASE_NAMESPACE))
    container = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["INFLIGHT_OPERATOR_LEASE_NAME"]["value"] == "inflight"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["INFLIGHT_OPERATOR_LIVENESS_PORT"]["value"] == "8080"
    off = parse_manifests(chart.render({"leaderElection": {"enabled": False, "leaseSeconds": 15}},
                                       name="inflight", namespace=RELEASE_NAMESPACE))
    assert one(off, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    assert "INFLIGHT_OPERATOR_LEASE_NAME" not in {e["name"] for e in
                                                  one(off, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    with pytest.raises(Exception, match="need leaderElection.enabled"):
        chart.render({"replicas": 2, "leaderElection": {"enabled": False, "leaseSeconds": 15}}, name="inflight")


@pytest.mark.parametrize(("case", "watch"), [("defaults", None), ("namespaced", WATCH_NAMESPACE)])
def test_uninstall_hook_stops_the_operator_then_releases_finalizers(objects, case: str, watch: str | None) -> None:
    objs = objects(case)
    job = one(objs, "Job")
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one(objs, "ServiceAccount")["metadata"]["name"]
    args = dict(a.removeprefix("--").split("=", 1) for a in pod["containers"][0]["args"])
    deploy = one(objs, "Deployment")
    assert args["operator-deployment"] == deploy["metadata"]["name"]
    selector = dict(kv.split("=", 1) for kv in args["operator-selector"].split(","))
    assert selector == deploy["spec"]["selector"]["matchLabels"]
    assert args.get("watch-namespace") == watch
    assert pod["containers"][0]["command"] == ["python", "-m", "inflight.operator.uninstall"]
