"""``spec.engine.kvOffloadingSize``: a CR engine field rendered as ``--kv-offloading-size``, bounded
by the CRD, and refused (Degraded, reason InvalidSpec, naming both values) when the pod's
``resources.memory`` cannot hold the host tier plus the runtime's margin."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from inflight.operator import crd, render
from inflight.operator.host_memory import HOST_MEMORY_MARGIN_GIB, quantity_bytes
from inflight.operator.refusals import invalid_spec
from tests.operator.helpers import make_spec


def _args(overrides: dict[str, Any]) -> list[str]:
    return render.render_pod_template(make_spec(overrides))["spec"]["containers"][0]["args"]


def test_the_field_renders_the_flag_and_fits_a_large_enough_pod() -> None:
    args = _args({"engine": {"kvOffloadingSize": 16}, "resources": {"memory": "18Gi"}})
    assert args[args.index("--kv-offloading-size") + 1] == "16"
    make_spec({"engine": {"kvOffloadingSize": 0.5}})  # no memory set: nothing to check against


@pytest.mark.parametrize(("overrides", "where"), [
    ({"engine": {"kvOffloadingSize": 16}, "resources": {"memory": "16Gi"}}, "spec.engine.kvOffloadingSize (16 GiB"),
    ({"engine": {"kvOffloadingSize": 8}, "resources": {"memory": "10G"}}, "spec.engine.kvOffloadingSize (8 GiB"),
    ({"engine": {"extraArgs": ["--kv-offloading-size", "30"]}, "resources": {"memory": "24Gi"}},
     "spec.engine.extraArgs --kv-offloading-size (30 GiB"),
    ({"engine": {"kvOffloadingSize": 1, "extraArgs": ["--kv-offloading-size=40"]}, "resources": {"memory": "32Gi"}},
     "extraArgs --kv-offloading-size (40 GiB"),  # extraArgs come last on the command line: they win
])
def test_a_tier_that_does_not_fit_the_pods_memory_is_refused_naming_both(overrides: dict[str, Any],
                                                                        where: str) -> None:
    with pytest.raises(ValueError) as info:
        make_spec(overrides)
    message = str(info.value)
    assert where in message and f"spec.resources.memory ({overrides['resources']['memory']}" in message
    condition = invalid_spec(message, 3).condition()  # what the handler writes on the CR
    assert (condition.type, condition.status, condition.reason) == ("Degraded", True, "InvalidSpec")
    assert condition.message == message


def test_the_margin_is_the_line() -> None:
    make_spec({"engine": {"kvOffloadingSize": 6}, "resources": {"memory": f"{6 + HOST_MEMORY_MARGIN_GIB:g}Gi"}})
    with pytest.raises(ValueError, match="at least 8Gi"):
        make_spec({"engine": {"kvOffloadingSize": 6}, "resources": {"memory": "8191Mi"}})


def test_bad_values_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="kv_offloading_size must be a number of GiB > 0"):
        make_spec({"engine": {"kvOffloadingSize": 0}})
    with pytest.raises(ValueError, match="extraArgs --kv-offloading-size needs a number"):
        make_spec({"engine": {"extraArgs": ["--kv-offloading-size", "lots"]}, "resources": {"memory": "8Gi"}})
    with pytest.raises(ValueError, match="spec.resources.memory 'plenty' is not a memory quantity"):
        make_spec({"engine": {"kvOffloadingSize": 1}, "resources": {"memory": "plenty"}})
    assert quantity_bytes("1536Mi", "x") == 1.5 * 2**30 and quantity_bytes("2G", "x") == 2e9


def test_the_crd_bounds_the_field_in_gib_not_as_a_fraction() -> None:
    engine = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["engine"]["properties"]
    prop = engine["kvOffloadingSize"]
    assert prop["type"] == "number" and "1048576" in prop["x-kubernetes-validations"][0]["rule"]
    jsonschema.validate(16.5, {k: v for k, v in prop.items() if not k.startswith("x-")})
