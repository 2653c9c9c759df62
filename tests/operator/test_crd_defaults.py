"""The CRD's defaults and the operator's parser agree: a spec the API server has defaulted
parses to exactly what the undefaulted spec parses to, for every example and for a spec that
sets every optional object to empty. A default changed on one side only fails here (the kmock
emulator now applies CRD defaults too, as an API server does)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from inflight.operator import crd
from inflight.operator.spec import parse_spec
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.kmock_schema import apply_defaults

SCHEMA = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
MINIMAL = {"model": {"pvc": {"claimName": "models"}}}
EMPTY_OBJECTS = {  # every optional object present and empty: the schema defaults its fields
    **MINIMAL, "engine": {}, "resources": {}, "autoscaling": {"enabled": True}, "service": {},
    "rollout": {}, "inferencePool": {"enabled": True, "endpointPicker": {}}, "probes": {
        "startup": {}, "liveness": {}, "readiness": {}},
}


def _defaulted(spec: dict[str, Any]) -> dict[str, Any]:
    doc = {"apiVersion": "inflight.dev/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": "demo", "namespace": "ns"}, "spec": copy.deepcopy(spec)}
    return apply_defaults(doc, SCHEMA)["spec"]


@pytest.mark.parametrize("spec", [MINIMAL, EMPTY_OBJECTS, *(load_example(p)["spec"] for p in EXAMPLES)],
                         ids=["minimal", "empty-objects", *(p.stem for p in EXAMPLES)])
def test_crd_defaults_parse_to_the_parsers_defaults(spec: dict[str, Any]) -> None:
    defaulted = _defaulted(spec)
    assert parse_spec("demo", "ns", defaulted) == parse_spec("demo", "ns", copy.deepcopy(spec))


def test_defaulting_fills_what_the_schema_declares() -> None:
    defaulted = _defaulted(EMPTY_OBJECTS)
    assert defaulted["autoscaling"]["scaleDownStabilizationSeconds"] == 300
    assert defaulted["service"] == {"type": "ClusterIP", "port": 8000}
    # No image default in the CRD: the operator's (the chart's runtimeImage) applies instead.
    assert "image" not in defaulted
    assert "engine" in defaulted and "apiKeySecretRef" not in defaulted  # no default invents an object


def test_the_drain_timeout_default_is_the_servers() -> None:
    """One home (``inflight.runtime.config.DRAIN_TIMEOUT_S``): the CR's default, the parser's and
    the server's ``--drain-timeout`` default are the same number."""
    from inflight.operator import fields
    from inflight.runtime.server.state import ServerSettings

    server = fields.default(ServerSettings, "drain_timeout_s")
    assert parse_spec("demo", "ns", MINIMAL).drain_timeout_seconds == server
    assert _defaulted(MINIMAL)["drainTimeoutSeconds"] == server


def test_the_installation_chooses_the_images_a_spec_leaves_out() -> None:
    from inflight.operator.spec import SpecDefaults

    env = {"INFLIGHT_OPERATOR_RUNTIME_IMAGE": "registry.local/rt:2", "INFLIGHT_OPERATOR_PICKER_IMAGE": "r/epp:3"}
    defaults = SpecDefaults.from_env(env)
    pool = {**MINIMAL, "inferencePool": {"enabled": True}}
    spec = parse_spec("demo", "ns", _defaulted(pool), defaults)
    assert (spec.image, spec.inference_pool.picker_image) == ("registry.local/rt:2", "r/epp:3")
    assert parse_spec("demo", "ns", {**pool, "image": "mine:1"}, defaults).image == "mine:1"
    assert SpecDefaults.from_env({}) == SpecDefaults()
    with pytest.raises(ValueError, match="INFLIGHT_OPERATOR_RUNTIME_IMAGE"):
        SpecDefaults.from_env({"INFLIGHT_OPERATOR_RUNTIME_IMAGE": ""})
