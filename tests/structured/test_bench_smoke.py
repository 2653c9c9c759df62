"""The structured-outputs benchmark script runs end to end (tiny model, tiny burst): both
bursts produce exactly the tokens asked for, without errors. Speed is not checked here."""

from __future__ import annotations

import json
from pathlib import Path

from bench.studies import structured


def test_structured_bench_runs(tmp_path: Path) -> None:
    from inflight.runtime.demo.model import make_demo_model

    model = make_demo_model(tmp_path / "m", arch="llama", size="tiny")
    out = tmp_path / "bench.json"
    rc = structured.main(["--model", str(model), "--num-requests", "4", "--max-tokens", "12", "--rounds", "1",
                          "--json", str(out)])
    summary = json.loads(out.read_text())
    assert rc == 0
    assert [(r["label"], r["num_constrained"], r["output_tokens"], r["errors"]) for r in summary["rounds"]] == [
        ("free", 0, 48, 0), ("mixed", 2, 48, 0)]
    assert summary["ratio"] > 0
