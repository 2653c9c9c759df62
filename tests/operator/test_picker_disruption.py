"""The endpoint picker gets no PodDisruptionBudget, on purpose (docs/kubernetes.md, "HA"): a budget
counts Ready pods and with leader election only the leader is Ready, so any budget over two or
more replicas would leave no disruption allowed and block every node drain on the leader; over one
replica it blocks drains or protects nothing. The runtime pods keep theirs."""

from __future__ import annotations

import pytest

from inflight.operator import reconcile
from inflight.operator.render import Owner
from inflight.operator.render_pool import picker_labels
from tests.operator.helpers import make_spec


@pytest.mark.parametrize("replicas", [1, 2, 5])
def test_no_budget_selects_the_picker_pods(replicas: int) -> None:
    spec = make_spec({"inferencePool": {"enabled": True, "endpointPicker": {"replicas": replicas}}})
    children = reconcile.rendered_children(spec, Owner(name=spec.name, uid="0b7c4e1e-0000-4000-8000-000000000003"))
    budgets = [body for _, body, _ in children if body["kind"] == "PodDisruptionBudget"]
    picker = [b for b in budgets if set(picker_labels(spec.name).items()) <= set(b["spec"]["selector"]["matchLabels"].items())]
    assert picker == []
    assert [b["metadata"]["name"] for b in budgets] == [spec.name]  # the runtime pods' budget stands
    pod_labels = next(body for _, body, _ in children if body["kind"] == "Deployment"
                      and body["metadata"]["name"] == f"{spec.name}-epp")["spec"]["template"]["metadata"]["labels"]
    assert not set(budgets[0]["spec"]["selector"]["matchLabels"].items()) <= set(pod_labels.items())
