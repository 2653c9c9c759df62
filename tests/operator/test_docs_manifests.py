"""Every InferenceDeployment manifest in the operator docs is complete and valid: the CRD schema
(strictly, unknown fields included) and the operator's own validation accept it."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from inflight.operator.spec import parse_spec
from tests.operator.helpers import CRD_PATH, REPO
from tests.operator.kmock_schema import strict_errors

DOCS = ["docs/model-sources.md", "docs/kubernetes.md", "docs/autoscaling.md", "docs/multi-node.md"]


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for doc in DOCS:
        for block in re.findall(r"```yaml\n(.*?)```", (REPO / doc).read_text(), re.S):
            for obj in yaml.safe_load_all(block):
                if isinstance(obj, dict) and obj.get("kind") == "InferenceDeployment":
                    found.append((f"{doc}:{obj['metadata']['name']}", obj))
    return found


MANIFESTS = _manifests()


def test_model_sources_page_has_a_manifest_per_source() -> None:
    sources = {next(k for k in ("hf", "pvc", "hostPath", "image") if k in m["spec"]["model"])
               for name, m in MANIFESTS if name.startswith("docs/model-sources.md")}
    assert sources == {"hf", "pvc", "hostPath", "image"}


@pytest.mark.parametrize(("where", "manifest"), MANIFESTS, ids=[w for w, _ in MANIFESTS])
def test_doc_manifest_is_valid(where: str, manifest: dict[str, Any]) -> None:
    schema = yaml.safe_load(CRD_PATH.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert strict_errors(manifest, schema) == [], where
    parse_spec(manifest["metadata"]["name"], manifest["metadata"].get("namespace", "default"), manifest["spec"])
