"""The ``unit`` marker's rule (:mod:`tests.kinds`) against files whose kind is known, and
``make test-fast`` selecting by the marker, not by a list that can drift."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import kinds

ROOT = kinds.ROOT
# Pure files (the hand-kept list ``make test-fast`` ran before the marker, and newer ones).
PURE = [
    "tests/runtime/test_block_pool.py", "tests/runtime/test_scheduler.py",
    "tests/server/test_protocol.py", "tests/server/test_responses.py", "tests/structured/test_parsers.py",
    "tests/structured/test_parser_adversarial.py", "tests/operator/test_render.py",
    "tests/operator/test_autoscaler.py", "tests/operator/test_spec_and_crd.py",
    "tests/operator/test_render_day_two.py", "tests/operator/test_crd_defaults.py",
    "tests/runtime/test_step_wire.py", "tests/runtime/test_vllm_flags.py", "tests/operator/test_render_new_fields.py",
]
# Files that start servers, processes, emulators or models, each for a reason the rule must see.
HEAVY = [
    "tests/server/test_admin.py", "tests/server/test_engine_process.py", "tests/runtime/test_engine_matches_transformers.py",
    "tests/operator/test_operator_kmock.py", "tests/hostile/test_hostile.py", "tests/test_import_side_effects.py",
    "tests/kernels/test_decode_attention.py",
    "tests/runtime/test_sampling.py",  # transformers through its sibling .hf_reference
    "tests/runtime/test_rope_scaling.py",  # transformers' configs: was in the old list, ~2 s to import
]


@pytest.mark.parametrize("name", PURE)
def test_pure_files_are_unit_tests(name: str) -> None:
    assert kinds.heavy_reason(ROOT / name) is None


@pytest.mark.parametrize("name", HEAVY)
def test_heavy_files_are_not(name: str) -> None:
    assert kinds.heavy_reason(ROOT / name) is not None


def test_a_helper_imported_by_a_bare_name_is_followed(tmp_path: Path) -> None:
    (tmp_path / "my_helpers.py").write_text("import subprocess\n")
    (tmp_path / "test_x.py").write_text("from my_helpers import run\n")
    (tmp_path / "test_y.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import aiohttp\n")
    (tmp_path / "test_z.py").write_text("def test():\n    import subprocess\n")
    assert "imports subprocess" in (kinds.heavy_reason(tmp_path / "test_x.py") or "")
    assert kinds.heavy_reason(tmp_path / "test_y.py") is None  # types only
    assert kinds.heavy_reason(tmp_path / "test_z.py") is None  # deferred: the rule reads module level


def test_a_fixture_from_a_heavy_conftest_makes_a_test_heavy() -> None:
    conftest = ROOT / "tests" / "server" / "conftest.py"
    assert kinds.item_heavy_reason(ROOT / "tests" / "server" / "test_protocol.py", [conftest]) is not None
    assert kinds.item_heavy_reason(ROOT / "tests" / "server" / "test_protocol.py", []) is None


def test_make_test_fast_selects_by_the_marker() -> None:
    """No list of files to forget a new one in: the target runs ``-m unit`` over the whole suite."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^test-fast:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe is not None, "Makefile has no test-fast target"
    assert "-m unit" in recipe.group(1) and ".py" not in recipe.group(1), recipe.group(1)
    assert "FAST_TESTS" not in makefile
