"""values.yaml documents every key, values.schema.json types every key and rejects bad values."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from chart_support import CHART_DIR, RELEASE_NAMESPACE, load_values

VALUES_FILE = CHART_DIR / "values.yaml"
SCHEMA_FILE = CHART_DIR / "values.schema.json"
KEY_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z_][\w.-]*):(?P<rest>.*)$")


def _undocumented_keys(path: Path) -> list[str]:
    """Keys with neither a comment line right above (same indent) nor an inline comment."""
    missing = []
    previous = ""
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = KEY_LINE.match(line)
        if match:
            above_is_comment = previous.startswith(match["indent"] + "#")
            inline = "#" in match["rest"] and not match["rest"].strip().startswith(("'", '"'))
            if not (above_is_comment or inline):
                missing.append(f"line {number}: {match['key']}")
        if line.strip():
            previous = line
    return missing


def _leaf_paths(tree: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        paths.add(path)
        if isinstance(value, dict) and value:
            paths |= _leaf_paths(value, path + ".")
    return paths


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.add(path)
        paths |= _schema_paths(sub, path + ".")
    return paths


def test_every_values_key_has_a_comment() -> None:
    assert _undocumented_keys(VALUES_FILE) == []


def test_the_comment_check_catches_a_bare_key(tmp_path: Path) -> None:
    sample = tmp_path / "values.yaml"
    sample.write_text("# -- documented\na: 1\nb:\n  # -- nested\n  c: 2\nd: 3\n")
    assert _undocumented_keys(sample) == ["line 3: b", "line 6: d"]


def test_schema_types_every_values_key() -> None:
    values = yaml.safe_load(VALUES_FILE.read_text())
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    # Free-form maps (labels, annotations, resources...) have no fixed keys below them.
    free_form = ("grafanaDashboard.labels.", "resources.requests.", "resources.limits.",
                 "activator.resources.requests.", "activator.resources.limits.")
    missing = sorted(
        p for p in _leaf_paths(values) - _schema_paths(schema) if not p.startswith(free_form)
    )
    assert missing == [], f"values.yaml keys absent from values.schema.json: {missing}"
    for case in ("all-on", "namespaced"):
        jsonschema.validate(_merged(values, load_values(case)), schema)


def _merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def test_defaults_pass_the_schema(chart: helm.Chart) -> None:
    chart.validate_schema(chart.values)
    chart.validate_schema({})


@pytest.mark.parametrize(
    "bad",
    [
        {"replicas": "x"},
        {"replicas": 3},
        {"replicas": -1},
        {"replica": 1},
        {"watchNamespace": "Not_A_Namespace"},
        {"image": {"pullPolicy": "Sometimes"}},
        {"image": {"repository": ""}},
        {"operator": {"logFormat": "xml"}},
        {"operator": {"livenessPort": 80}},
        {"serviceMonitor": {"enabled": "yes"}},
        {"serviceMonitor": {"interval": "fast"}},
        {"serviceMonitor": {"authorization": {"secretName": "Not_A_Secret"}}},
        {"serviceMonitor": {"authorization": {"secretName": "t", "key": ""}}},
        {"serviceMonitor": {"authorization": {"name": "t"}}},
        {"resources": {"limits": {"memory": "lots"}}},
        {"rbac": {"create": "true"}},
    ],
    ids=lambda bad: json.dumps(bad, separators=(",", ":")),
)
def test_schema_rejects_bad_values(chart: helm.Chart, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)
    # Rendering (what `helm install` does) refuses them too.
    with pytest.raises(helm.HelmError):
        chart.render(bad, name="inflight", namespace=RELEASE_NAMESPACE)
