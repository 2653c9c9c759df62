"""Smoke tests for the benchmark suite: the client and report against a real ``inflight serve``
process on a tiny model, the overhead probe at tiny sizes, and the stats helpers."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from inflight.bench import overhead, report, workloads
from inflight.bench.client import RequestSpec, run_workload
from inflight.bench.stats import combine, percentile, summarize
from inflight.bench.systems import RunningServer, SystemSpec


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("bench-model") / "tiny", size="tiny", eos=False)


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_lognormal_lengths_are_seeded_and_clipped() -> None:
    a = workloads.lognormal_lengths(random.Random(1), 200, 32, 1.0, 4, 64)
    assert a == workloads.lognormal_lengths(random.Random(1), 200, 32, 1.0, 4, 64)
    assert min(a) >= 4 and max(a) <= 64 and len(set(a)) > 10


def test_client_and_report_against_a_real_server(tiny_model: Path, tmp_path: Path) -> None:
    from inflight.runtime.tokenizer import load_tokenizer

    shape = workloads.WorkloadShape(6, 12, 6, max_prompt=24, max_output=10)
    specs = workloads.burst(load_tokenizer(tiny_model), shape, seed=3)
    spec = SystemSpec("inflight", "inflight", ("--max-num-sequences", "4", "--num-kv-blocks", "64",
                                                "--max-model-len", "128"))
    with RunningServer(spec, tiny_model, tmp_path / "server.log") as server:
        run = run_workload(server.url, server.model_name, specs, timeout_s=60)
        bad = run_workload(server.url, "no-such-model", [RequestSpec("x", 2)], timeout_s=30)
    assert bad.results[0].error is not None and bad.results[0].error.startswith("HTTP 4")
    for spec_, result in zip(specs, run.results, strict=True):
        assert result.error is None
        assert result.num_output_tokens == spec_.max_tokens  # no reachable EOS
        assert result.num_prompt_tokens > 0
        assert 0 < result.ttft_s <= result.e2e_s
        assert len(result.gaps_s) <= spec_.max_tokens - 1
    summary = summarize(run)
    assert summary.errors == 0 and summary.output_tok_s > 0
    assert summary.total_tok_s > summary.output_tok_s
    rows = {"inflight": combine([summary, summary]), "peer": combine([summary])}
    table = report.results_table(rows, "peer")
    assert "| inflight |" in table and "1.00x" in table
    png = tmp_path / "plot.png"
    report.plot_curves({"inflight": [rows["inflight"]]}, png, "smoke")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_overhead_probe_on_a_tiny_model(tiny_model: Path) -> None:
    result = overhead.measure(tiny_model, 4, num_steps=3)
    assert result.num_running == 4
    assert 0.0 < result.overhead_frac < 1.0
    assert result.phase_ms["forward"] > 0
    assert len(overhead.table_rows([result])[0]) == len(overhead.TABLE_HEADER)
