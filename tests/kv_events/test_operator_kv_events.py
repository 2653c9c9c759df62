"""The operator's KV-event wiring, table-driven: with inferencePool on, the runtime pods publish
(their args parse into an EngineConfig whose events config binds llm-d's port under the
``kv@<pod-ip>:<port>@<model>`` topic), and an llm-d scheduler picker gets the precise-prefix
scorer dialing that port; nothing without a pool, with prefix caching off, or when extraArgs set
the flag; the Gateway API Inference Extension's own picker is left as it was."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from inflight.operator import render, render_kv_events, render_pool
from inflight.operator.render import Owner
from inflight.runtime.cli import command as cli
from inflight.runtime.kv_events.config import parse_kv_events_config
from tests.operator.helpers import make_spec

OWNER = Owner(name="demo", uid="u1")
POOL = {"inferencePool": {"enabled": True,  # GIE's picker: no precise-prefix scorer
                          "endpointPicker": {"image": "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.0"}}}
LLMD = {"inferencePool": {"enabled": True,
                          "endpointPicker": {"image": "ghcr.io/llm-d/llm-d-inference-scheduler:v0.8.0"}}}


def _container(overrides: dict[str, Any]) -> dict[str, Any]:
    return render.render_deployment(make_spec(overrides), OWNER, 1)["spec"]["template"]["spec"]["containers"][0]


def _flag(args: list[str]) -> str | None:
    return args[args.index("--kv-events-config") + 1] if "--kv-events-config" in args else None


@pytest.mark.parametrize(("overrides", "publishes"), [
    ({}, False),
    (POOL, True),
    ({**POOL, "engine": {"enablePrefixCaching": False}}, False),  # nothing would ever be stored
    ({**POOL, "engine": {"extraArgs": ["--kv-events-config", '{"enable_kv_cache_events": false}']}}, False),
])
def test_pods_publish_where_the_picker_dials_when_the_pool_is_on(overrides: dict[str, Any], publishes: bool) -> None:
    container = _container(overrides)
    ours = render_kv_events.runtime_args(make_spec(overrides), render.CONTAINER_PORT)
    env = {e["name"]: e for e in container.get("env", [])}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert bool(ours) is publishes and ("POD_IP" in env) is publishes
    assert ports.get("kv-events") == (render_kv_events.KV_EVENTS_PORT if publishes else None)
    if not publishes:
        return
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    # The kubelet expands $(POD_IP) (and the live knobs' $(INFLIGHT_LIVE_...), numbers from the
    # ConfigMap); the runtime's own parser then takes the flag.
    args = [re.sub(r"\$\((\w+)\)", lambda m: "10.0.0.7" if m[1] == "POD_IP" else "64", a) for a in container["args"]]
    config = cli.engine_config_from_args(cli.build_parser().parse_args(args))
    events = parse_kv_events_config(config.kv_events_config)
    served = make_spec(overrides).model.served_model_name
    assert events.publishes and events.endpoint == "tcp://*:5557"
    assert events.topic == f"kv@10.0.0.7:{render.CONTAINER_PORT}@{served}"


def test_the_gateway_picker_is_left_alone_and_an_llm_d_picker_gets_the_precise_scorer() -> None:
    assert "--config-text" not in render_pool.picker_args(make_spec(POOL))
    spec = make_spec({**LLMD, "engine": {"blockSize": 32}})
    args = render_pool.picker_args(spec)
    config = yaml.safe_load(args[args.index("--config-text") + 1])
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    scorer = plugins["precise-prefix-cache-scorer"]
    assert scorer["tokenProcessorConfig"]["blockSize"] == 32  # the engine's block size
    events = scorer["kvEventsConfig"]
    assert events["discoverPods"] and events["podDiscoveryConfig"]["socketPort"] == render_kv_events.KV_EVENTS_PORT
    pod_topic = render_kv_events.topic(spec, render.CONTAINER_PORT)
    assert pod_topic.startswith(events["topicFilter"])
    assert plugins["token-producer"]["modelName"] == spec.model.served_model_name
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    assert set(refs) <= set(plugins) and "precise-prefix-cache-scorer" in refs
    # Without events (prefix caching off) the llm-d picker gets no scorer that would wait for them.
    off = make_spec({**LLMD, "engine": {"enablePrefixCaching": False}})
    assert "--config-text" not in render_pool.picker_args(off)
    assert json.loads(json.dumps(config)) == config  # plain data, renders as YAML or JSON
