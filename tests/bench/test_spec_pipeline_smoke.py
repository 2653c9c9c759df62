"""Smoke test of the pipelined-speculation bench at tiny sizes: the three engines (synchronous,
async with speculating steps drained, async pipelined) run the same bursts, give the same tokens,
and the counters say which engine drained and which pipelined."""

from __future__ import annotations

from pathlib import Path

from bench.studies.spec_pipeline import SYSTEMS, measure, table
from inflight.runtime.demo.model import make_demo_model


def test_drained_and_pipelined_engines_give_the_synchronous_tokens(tmp_path: Path) -> None:
    target = make_demo_model(tmp_path / "tiny", "llama", "tiny", eos=False)
    results = measure(target, target, [[1, 50, 60, 70, 80, 90], [3, 4, 5]], batches=[2], reps=2, k=2, max_tokens=10)
    row = results["2"]
    assert row["same_tokens"] is True
    assert all(len(row[s]["tok_s"]) == 2 and row[s]["acceptance"] > 0.9 for s in SYSTEMS)  # itself as draft
    assert row["async, drained"]["spec_pipelined"] == 0 and row["async, drained"]["drained"] > 0
    assert row["async, pipelined"]["spec_pipelined"] > 0 and row["async, pipelined"]["drained"] <= 2
    assert "async, pipelined" in table(results)


def test_the_ngram_method_runs_pipelined_too(tmp_path: Path) -> None:
    target = make_demo_model(tmp_path / "tiny", "llama", "tiny", eos=False)
    prompt = [5, 6, 7, 8] * 6  # repetitive: n-gram matches
    row = measure(target, None, [prompt], batches=[1], reps=1, k=2, max_tokens=12)["1"]
    assert row["same_tokens"] is True and row["async, pipelined"]["spec_pipelined"] > 0
