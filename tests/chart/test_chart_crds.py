"""The chart's crds/ is a byte-for-byte copy of the top-level crds/ (`make crds`), and image
names and tags agree between values.yaml, Chart.yaml, the CRD defaults and CONTRACTS.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from chart_support import CHART_DIR, REPO

SOURCE_DIR = REPO / "crds"
CHART_CRDS_DIR = CHART_DIR / "crds"
CRD_FILE = SOURCE_DIR / "inflight.dev_inferencedeployments.yaml"
CONTRACTS = REPO / "docs" / "CONTRACTS.md"


def _crd() -> dict[str, Any]:
    if not CRD_FILE.is_file():
        pytest.fail(f"{CRD_FILE.relative_to(REPO)} is missing (the operator issue writes it)")
    return yaml.safe_load(CRD_FILE.read_text())


def _files(directory: Path) -> dict[str, bytes]:
    if not directory.is_dir():
        return {}
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_chart_crds_equal_the_source() -> None:
    _crd()
    source, copy = _files(SOURCE_DIR), _files(CHART_CRDS_DIR)
    stale = sorted(n for n in source.keys() | copy.keys() if source.get(n) != copy.get(n))
    assert stale == [], f"charts/inflight/crds/ differs from crds/ in {stale}: run `make crds`"


def test_helm_loads_the_crd(chart: helm.Chart) -> None:
    crd = _crd()
    loaded = [yaml.safe_load(c["data"]) for c in chart.crds]
    assert [c["metadata"]["name"] for c in loaded] == [crd["metadata"]["name"]]
    kubernetes_validate.validate(loaded[0], "1.30", strict=True)


def test_crd_names_match_the_contract() -> None:
    crd = _crd()
    assert crd["spec"]["group"] == "inflight.dev"
    assert crd["spec"]["names"]["plural"] == "inferencedeployments"
    assert "infd" in crd["spec"]["names"]["shortNames"]


def _contract_images() -> dict[str, str]:
    found = re.findall(r"ghcr\.io/inflight-dev/inflight-(runtime|operator):([\w.-]+)", CONTRACTS.read_text())
    return {role: f"ghcr.io/inflight-dev/inflight-{role}:{tag}" for role, tag in found}


def test_image_names_agree_everywhere(chart: helm.Chart) -> None:
    values = chart.values
    runtime = f"{values['runtimeImage']['repository']}:{values['runtimeImage']['tag']}"
    operator = f"{values['image']['repository']}:{values['image']['tag']}"
    assert _contract_images() == {"runtime": runtime, "operator": operator}
    app_version = chart.metadata["appVersion"]
    assert values["image"]["tag"] == values["runtimeImage"]["tag"] == app_version

    # The operator's built-in default is the chart's default; the CRD has none of its own (it
    # would fill in the built-in one before the operator's, the chart's, could apply).
    from inflight.operator.spec import SpecDefaults

    assert SpecDefaults().runtime_image == runtime
    picker = f"{values['pickerImage']['repository']}:{values['pickerImage']['tag']}"
    assert SpecDefaults().picker_image == picker
    spec = _crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert "default" not in spec["properties"]["image"]
    endpoint_picker = spec["properties"]["inferencePool"]["properties"]["endpointPicker"]["properties"]
    assert "default" not in endpoint_picker["image"]

    for name, image in (("runtime", runtime), ("operator", operator)):
        dockerfile = (REPO / "docker" / f"{name}.Dockerfile").read_text()
        assert f"-t {image} ." in dockerfile, f"docker/{name}.Dockerfile's build line should tag {image}"
