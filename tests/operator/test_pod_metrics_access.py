"""Who may read a rendered pod's /metrics: the runtime container the operator renders, with its
Secrets and ConfigMap resolved and ``$(VAR)`` expanded as the kubelet does, is parsed by the
runtime's own CLI (whose settings refuse contradictory keys) and asked by the runtime's own
``metrics_refusal``. The operator's autoscaler (admin key) must always get in; Prometheus with the
token of ``metricsApiKeySecretRef`` (the chart's ``serviceMonitor.authorization``) too; the
InferencePool's endpoint picker (no key) wherever a pool is rendered."""

from __future__ import annotations

import re
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from inflight.operator import render
from inflight.operator.render import Owner
from inflight.runtime.cli import command as cli
from inflight.runtime.server.auth import metrics_refusal
from tests.operator.helpers import make_spec

OWNER = Owner(name="demo", uid="uid-1")
SECRETS = {("api", "api-key"): "inference-key", ("prom", "token"): "scrape-token",
           (render.admin_secret_name("demo"), render.ADMIN_KEY): "admin-key"}
API = {"apiKeySecretRef": {"name": "api"}}
METRICS = {"metricsApiKeySecretRef": {"name": "prom"}}
POOL = {"inferencePool": {"enabled": True}}

# (spec overrides, the readers whose GET /metrics is answered; the others get a 401)
CASES = [
    ({}, {None, "inference-key", "scrape-token", "admin-key"}),  # no key: anyone may call the API too
    (API, {"inference-key", "admin-key"}),  # the chart's token alone gets a 401 here
    ({**API, **METRICS}, {"scrape-token", "admin-key"}),  # inference clients no longer read it
    (METRICS, {"scrape-token", "admin-key"}),
    ({**API, **POOL}, {None, "inference-key", "scrape-token", "admin-key"}),  # --open-metrics for the picker
]


def _container_env(spec_overrides: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    spec = make_spec(spec_overrides)
    container = render.render_deployment(spec, OWNER, 1)["spec"]["template"]["spec"]["containers"][0]
    config = render.render_configmap(spec, OWNER)["data"]
    env: dict[str, str] = {}
    for var in container["env"]:
        source = var.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = SECRETS[(ref["name"], ref["key"])]
        elif "configMapKeyRef" in source:
            env[var["name"]] = config[source["configMapKeyRef"]["key"]]
        elif "fieldRef" in source:  # the downward API (POD_IP, for the KV events' topic)
            env[var["name"]] = {"status.podIP": "10.0.0.7"}[source["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = var["value"]
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in container["args"]]
    return args, env


@pytest.mark.parametrize(("overrides", "readers"), CASES)
def test_rendered_pods_answer_metrics_to_the_right_readers(
        overrides: dict[str, Any], readers: set[str | None], monkeypatch: pytest.MonkeyPatch) -> None:
    args, env = _container_env(overrides)
    for name in ("INFLIGHT_API_KEY", "INFLIGHT_ADMIN_API_KEY", "INFLIGHT_METRICS_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = cli.server_settings_from_args(cli.build_parser().parse_args(args))  # refuses contradictions
    for reader in (None, "inference-key", "scrape-token", "admin-key"):
        headers = {} if reader is None else {"Authorization": f"Bearer {reader}"}
        refused = metrics_refusal(make_mocked_request("GET", "/metrics", headers=headers), settings)
        assert (refused is None) is (reader in readers), f"{reader!r} on {sorted(overrides)}"
