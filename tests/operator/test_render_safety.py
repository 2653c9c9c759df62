"""What the rendered children promise an SRE: a progress deadline that follows the startup
budget (a slow, healthy load never reads ProgressDeadlineExceeded), a configurable PDB, and
example pods that are not BestEffort."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from inflight.operator import pod_runtime, render
from inflight.operator.render import Owner
from inflight.operator.spec import SpecDefaults, parse_spec
from tests.operator.helpers import EXAMPLES, load_example, make_spec

OWNER = Owner(name="demo", uid="uid-1")


def _deadline(overrides: dict[str, Any]) -> int:
    return render.render_deployment(make_spec(overrides), OWNER, 1)["spec"]["progressDeadlineSeconds"]


@pytest.mark.parametrize(("probes", "deadline"), [
    ({}, 910),  # 10 s x 60 startup + 5 s x 2 readiness + 300 s margin
    ({"startup": {"periodSeconds": 10, "failureThreshold": 240}}, 2710),  # a 40-minute load
    ({"startup": {"periodSeconds": 10, "failureThreshold": 240, "initialDelaySeconds": 60}}, 2770),
    ({"startup": {"periodSeconds": 1, "failureThreshold": 10}}, 600),  # never below Kubernetes' default
])
def test_progress_deadline_follows_the_startup_budget(probes: dict[str, Any], deadline: int) -> None:
    assert _deadline({"probes": probes}) == deadline


def test_a_40_minute_budget_is_covered_with_room_to_spare() -> None:
    spec = make_spec({"probes": {"startup": {"periodSeconds": 10, "failureThreshold": 240}}})
    assert pod_runtime.startup_budget_seconds(spec.runtime) == 2400
    assert _deadline({"probes": {"startup": {"periodSeconds": 10, "failureThreshold": 240}}}) > 2400 + 240


@pytest.mark.parametrize(("budget", "rendered"), [({}, 1), ({"maxUnavailable": 2}, 2),
                                                   ({"maxUnavailable": "25%"}, "25%")])
def test_pdb_max_unavailable_comes_from_the_spec(budget: dict[str, Any], rendered: int | str) -> None:
    pdb = render.render_pdb(make_spec({"disruptionBudget": budget}), OWNER)
    assert pdb["spec"]["maxUnavailable"] == rendered


@pytest.mark.parametrize(("budget", "message"), [
    ({"maxUnavailable": 0}, "blocks every node drain"),
    ({"maxUnavailable": "0%"}, "blocks every node drain"),
    ({"maxUnavailable": -1}, "integer >= 0 or a percentage"),
    ({"minAvailable": 1}, "unknown keys minAvailable"),
])
def test_a_pdb_that_blocks_drains_is_refused(budget: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_spec({"disruptionBudget": budget})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_gpu_pods_request_cpu_and_memory(path: pathlib.Path) -> None:
    """No example renders a BestEffort pod (a GPU request alone does not count for QoS)."""
    doc = load_example(path)
    spec = parse_spec(doc["metadata"]["name"], "default", doc["spec"], SpecDefaults())
    requests = render.render_pod_template(spec)["spec"]["containers"][0]["resources"]["requests"]
    assert {"cpu", "memory"} <= set(requests), f"{path.name}: requests {requests}"
