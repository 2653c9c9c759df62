"""Smoke test of the draft-model speculation bench at tiny sizes: a model cut to its first
layers loads as a draft with the same tokenizer, and the side-by-side measurement reports a
TPOT per system and the draft acceptance."""

from __future__ import annotations

import json
from pathlib import Path

from bench.studies.spec_draft import System, _draft, measure, truncated_copy
from inflight.runtime.demo.model import make_demo_model


def test_a_truncated_draft_measured_beside_none(tmp_path: Path) -> None:
    target = make_demo_model(tmp_path / "tiny", "llama", "tiny", eos=False)
    draft = truncated_copy(target, tmp_path / "one-layer", 1)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    systems = [System("none", target, None), System("draft", target, _draft(draft, 2)),
               System("itself", target, _draft(target, 2))]  # fmt: skip
    results = measure(systems, {target: [[1, 50, 60, 70, 80, 90]]}, reps=2, max_tokens=8)
    assert set(results) == {"none", "draft", "itself"}
    assert all(r["tpot_p50_ms"] > 0 and len(r["tpots_ms"]) == 2 for r in results.values())
    assert results["none"]["acceptance"] is None and results["itself"]["acceptance"] > 0.9
