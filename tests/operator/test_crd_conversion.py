"""The storage-version plan in docs/kubernetes.md ("Upgrades"), run on today's CRD: one version
(``v1alpha1``) ships, so the conversion is checked as the plan will do it. Release N adds
``v1beta1`` served beside the stored ``v1alpha1`` with the same schema and
``conversion.strategy: None`` (the API server only rewrites ``apiVersion``); every field of a
full InferenceDeployment and its status survives that round trip unpruned; the upgrade hook
accepts each release's CRD in order and refuses the one that stops serving a version objects
are still stored in."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from inflight.operator import crd, crd_upgrade
from tests.operator import kmock_schema
from tests.operator.helpers import EXAMPLES, load_example
from tests.operator.test_crd_upgrade import CR, STATUS


def _release(step: int) -> dict[str, Any]:
    """The CRD of release N (step 1), N+1 (2: v1beta1 stored) and N+2 (3: v1alpha1 no longer served)."""
    doc = crd.build_crd()
    (alpha,) = doc["spec"]["versions"]
    beta = copy.deepcopy(alpha)
    beta["name"] = "v1beta1"
    alpha["storage"], beta["storage"] = step == 1, step >= 2
    alpha["served"] = step < 3
    alpha["deprecated"] = True
    doc["spec"]["versions"] = [alpha, beta]
    doc["spec"]["conversion"] = {"strategy": "None"}
    return doc


def _convert(obj: dict[str, Any], version: str) -> dict[str, Any]:
    """``conversion.strategy: None``: the API server rewrites apiVersion and nothing else."""
    return {**copy.deepcopy(obj), "apiVersion": f"inflight.dev/{version}"}


def _schema(doc: dict[str, Any], version: str) -> dict[str, Any]:
    return next(v for v in doc["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]


def _stored_crs() -> list[dict[str, Any]]:
    crs = [copy.deepcopy(load_example(p)) for p in EXAMPLES]
    crs.append({**copy.deepcopy(CR), "status": copy.deepcopy(STATUS)})
    return crs


def test_a_v1alpha1_object_round_trips_through_v1beta1_with_nothing_pruned() -> None:
    doc = _release(1)
    assert _schema(doc, "v1alpha1") == _schema(doc, "v1beta1")  # the plan: the same structural schema
    for stored in _stored_crs():
        assert kmock_schema.strict_errors(stored, _schema(doc, "v1alpha1")) == [], stored["metadata"]["name"]
        beta = _convert(stored, "v1beta1")
        assert kmock_schema.strict_errors(beta, _schema(doc, "v1beta1")) == [], stored["metadata"]["name"]
        assert _convert(beta, "v1alpha1") == stored  # back to the stored version, unchanged


def test_the_upgrade_hook_takes_the_releases_in_order_and_refuses_a_skipped_migration() -> None:
    today = {**crd.build_crd(), "status": {"storedVersions": ["v1alpha1"]}}
    crd_upgrade.check_compatible(today, _release(1))  # N: v1beta1 served beside
    crd_upgrade.check_compatible({**_release(1), "status": {"storedVersions": ["v1alpha1"]}}, _release(2))
    # N+2 drops v1alpha1 from serving but keeps it in the CRD's versions: still readable.
    crd_upgrade.check_compatible({**_release(2), "status": {"storedVersions": ["v1alpha1", "v1beta1"]}}, _release(3))
    removed = _release(3)
    removed["spec"]["versions"] = [v for v in removed["spec"]["versions"] if v["name"] != "v1alpha1"]
    with pytest.raises(crd_upgrade.UpgradeError, match="v1alpha1"):  # objects not migrated yet
        crd_upgrade.check_compatible({**_release(3), "status": {"storedVersions": ["v1alpha1", "v1beta1"]}},
                                     removed)
    crd_upgrade.check_compatible({**_release(3), "status": {"storedVersions": ["v1beta1"]}}, removed)  # migrated


def test_every_release_crd_names_exactly_one_storage_version() -> None:
    for step in (1, 2, 3):
        versions = _release(step)["spec"]["versions"]
        assert [v["name"] for v in versions if v["storage"]] == (["v1alpha1"] if step == 1 else ["v1beta1"])
        assert any(v["served"] for v in versions if v["storage"])
