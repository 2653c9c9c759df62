"""The operator tests need the operator extra and the test tools (kopf, kmock, the Kubernetes
client, jsonschema); a bare GPU machine has none of them, so there the whole folder skips."""

import pytest

for _module in ("kopf", "kmock", "kubernetes.aio", "jsonschema", "kubernetes_validate"):
    pytest.importorskip(_module)
