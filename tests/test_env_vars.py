"""The registry of ``INFLIGHT_*`` environment variables: complete, documented, typed accessors."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import torch

from inflight import env_vars

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"\bINFLIGHT_[A-Z0-9_]+")
# C header guards, not variables.
NOT_VARIABLES = {"INFLIGHT_CPU_HALF_H", "INFLIGHT_CPU_SIMD_H"}


def _sources() -> list[Path]:
    files = [*ROOT.joinpath("inflight").rglob("*.py"), *ROOT.joinpath("scripts").rglob("*.py"), ROOT / "Makefile"]
    # tests/chart/ passes arbitrary user env names through the chart: not ours to register
    files += [p for p in ROOT.joinpath("tests").rglob("*.py") if "chart" not in p.parts and p.name != Path(__file__).name]
    files += [*ROOT.joinpath("charts").rglob("*.yaml")]
    return [f for f in files if f.exists()]


def test_every_name_in_the_tree_is_registered() -> None:
    unregistered: dict[str, str] = {}
    for path in _sources():
        for name in set(NAME.findall(path.read_text(errors="replace"))) - NOT_VARIABLES:
            if name.endswith("_") and any(p.startswith(name) for p in env_vars.PREFIXES):
                continue  # a family's prefix (INFLIGHT_LIVE_), or INFLIGHT_OPERATOR_* in prose
            if name.endswith("_") and any(n.startswith(name) for n in env_vars.REGISTRY):
                continue
            try:
                env_vars.lookup(name)
            except KeyError:
                unregistered[name] = str(path.relative_to(ROOT))
    assert not unregistered, f"register these in inflight/env_vars.py: {unregistered}"


def test_every_registered_name_is_used() -> None:
    text = "\n".join(p.read_text(errors="replace") for p in _sources() if p.name != "env_vars.py")
    unused = [v.name for v in env_vars.VARIABLES if v.name.partition("<")[0] not in text]
    assert not unused, f"registered but never read: {unused}"


def test_every_reader_is_a_module_that_names_the_variable() -> None:
    """``readers`` are dotted module paths (or the Makefile) that mention the name: a module that
    moved leaves no stale path in docs/environment.md."""
    wrong = []
    for var in env_vars.VARIABLES:
        for reader in var.readers:
            path = ROOT / reader if reader == "Makefile" else ROOT.joinpath(*reader.split(".")).with_suffix(".py")
            if not path.exists():
                path = ROOT.joinpath(*reader.split("."), "__init__.py")
            if not path.exists() or var.name.partition("<")[0] not in path.read_text(errors="replace"):
                wrong.append((var.name, reader))
    assert not wrong, f"readers that are not modules reading the variable: {wrong}"


def test_the_doc_table_is_current() -> None:
    doc = (ROOT / "docs" / "environment.md").read_text()
    assert doc == env_vars.with_table(doc), "docs/environment.md is stale: python -m inflight.env_vars"


def test_rows_are_well_formed() -> None:
    for var in env_vars.VARIABLES:
        assert var.name.startswith("INFLIGHT_") and var.meaning and var.readers, var
        assert var.type in (str, int, float, bool), var
        assert var.default is None or isinstance(var.default, var.type), var


@pytest.mark.parametrize(
    ("reader", "environ", "expected"),
    [
        (env_vars.read_int, {}, 8192),
        (env_vars.read_int, {"INFLIGHT_TP_INLINE_INTS": " 16 "}, 16),
        (env_vars.read_int, {"INFLIGHT_TP_INLINE_INTS": ""}, 8192),
        (env_vars.read_float, {"INFLIGHT_TP_INLINE_INTS": "2.5"}, 2.5),
        (env_vars.read_str, {}, "8192"),
        (env_vars.read_str, {"INFLIGHT_TP_INLINE_INTS": "x"}, "x"),
    ],
)
def test_accessors(reader, environ: dict[str, str], expected: object) -> None:
    assert reader("INFLIGHT_TP_INLINE_INTS", environ) == expected


def test_accessor_errors_and_bools() -> None:
    with pytest.raises(ValueError, match="INFLIGHT_TP_INLINE_INTS must be an integer"):
        env_vars.read_int("INFLIGHT_TP_INLINE_INTS", {"INFLIGHT_TP_INLINE_INTS": "lots"})
    with pytest.raises(KeyError, match="not a registered"):
        env_vars.read_str("INFLIGHT_NO_SUCH_THING", {})
    assert env_vars.read_str("INFLIGHT_CACHE_DIR", {}) is None
    assert env_vars.lookup("INFLIGHT_LIVE_MAX_QUEUE_LEN").name == "INFLIGHT_LIVE_<FIELD>"
    for raw, expected in (("", False), ("0", False), ("1", True), ("yes", True)):
        assert env_vars.read_bool("INFLIGHT_SINGLE_PROCESS", {"INFLIGHT_SINGLE_PROCESS": raw}) is expected


def test_operator_defaults_are_the_config_defaults() -> None:
    pytest.importorskip("kopf", reason="the operator extra (kopf) is not installed")
    from inflight.operator.context import OperatorConfig

    fields = {f.name: f.default for f in dataclasses.fields(OperatorConfig)}
    for var, field in (("TICK_SECONDS", "tick_seconds"), ("POD_TIMEOUT_SECONDS", "pod_timeout_seconds"),
                       ("LEASE_NAME", "lease_name"), ("LEASE_SECONDS", "lease_seconds"),
                       ("LIVENESS_PORT", "liveness_port"), ("ROOT_SECRET", "root_secret")):
        assert env_vars.lookup(f"INFLIGHT_OPERATOR_{var}").default == fields[field], var


def test_kernel_backend_override_says_so(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from inflight.kernels.dispatch import TORCH_OPS, get_kernel_ops

    monkeypatch.setenv("INFLIGHT_KERNEL_BACKEND", "torch")
    with caplog.at_level(logging.WARNING, logger="inflight.kernels.dispatch"):
        assert get_kernel_ops("auto", torch.device("cpu")) is TORCH_OPS
    assert "INFLIGHT_KERNEL_BACKEND=torch overrides the configured kernel backend 'auto'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="inflight.kernels.dispatch"):
        get_kernel_ops("torch", torch.device("cpu"))
    assert "overrides" not in caplog.text  # the same value: nothing to say
