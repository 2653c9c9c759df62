"""The LeaderWorkerSet CRD as test data: ``data/lws-crd-v1.json.gz``, and how it was made.

The fixture is the CRD of kubernetes-sigs/lws (``config/crd/bases/
leaderworkerset.x-k8s.io_leaderworkersets.yaml`` at commit
060ab4da17eea1f0865fcbd3236bb1075e2cea32; Apache-2.0, Copyright The Kubernetes Authors) with
every ``description`` removed (1.3 MB of prose -> 8 KB gzipped); the schema itself (types,
enums, defaults, required fields, the embedded pod template schema) is untouched. Regenerate
with ``python -m tests.operator.lws_fixture <path to that yaml>``. Knows nothing about the operator.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import yaml

FIXTURE = Path(__file__).parent / "data" / "lws-crd-v1.json.gz"
SOURCE = ("kubernetes-sigs/lws@060ab4da17eea1f0865fcbd3236bb1075e2cea32:"
          "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml (Apache-2.0)")


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != "description"}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def load_crd() -> dict[str, Any]:
    """The LWS CustomResourceDefinition (descriptions stripped)."""
    return json.loads(gzip.decompress(FIXTURE.read_bytes()))


def lws_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``leaderworkerset.x-k8s.io/v1``."""
    (version,) = [v for v in load_crd()["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def main(path: str) -> None:
    crd = _strip(yaml.safe_load(Path(path).read_text()))
    crd.setdefault("metadata", {}).setdefault("annotations", {})["inflight.dev/fixture-source"] = SOURCE
    text = json.dumps(crd, sort_keys=True, separators=(",", ":"))
    FIXTURE.write_bytes(gzip.compress(text.encode(), mtime=0))


if __name__ == "__main__":
    main(sys.argv[1])
