"""Smoke tests of the host-path studies at tiny sizes: a served burst on the simulated device
reports device busy, delivered tokens and CPU per token by process; the real-model study runs
inflight alone (no vLLM here) and prints its table. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.studies import host_path, host_path_peer
from inflight.bench import client


def test_a_simulated_burst_reports_busy_tokens_and_cpu(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    assert host_path.main(["--streams", "4", "--tokens", "6", "--step-ms", "1", "--size", "tiny",
                           "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["errors"] == 0 and row["tokens"] == 4 * 6  # every stream exactly its tokens (ignore_eos)
    assert 0 < row["device_busy"] <= 1
    assert {"front end", "engine core"} <= set(row["cpu_us_per_token"])
    assert row["client_loop"] == "auto"


def test_ignore_eos_is_sent_only_when_a_spec_asks() -> None:
    assert "ignore_eos" not in client.completion_body("m", client.RequestSpec("x", 3))  # peers reject it
    assert client.completion_body("m", client.RequestSpec("x", 3, ignore_eos=True))["ignore_eos"] is True


def test_the_client_loop_is_uvloop_where_installed_and_asyncio_on_request() -> None:
    uvloop = pytest.importorskip("uvloop")
    assert client._loop_factory("auto") is uvloop.new_event_loop is client._loop_factory("uvloop")
    assert client._loop_factory("asyncio") is None
    with pytest.raises(ValueError, match="auto, uvloop or asyncio"):
        client._loop_factory("trio")


def test_the_real_model_study_runs_without_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs.json"
    assert host_path_peer.main(["--no-vllm", "--streams", "3", "--tokens", "5", "--repeats", "1",
                                "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())
    assert run["system"] == host_path_peer.OURS and run["errors"] == 0 and run["tokens"] > 0
    assert "| inflight (defaults) |" in capsys.readouterr().out


def test_the_bfloat16_study_runs_inflights_systems_without_vllm(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Every inflight system of bench.studies.cpu_bf16 serves its burst in full; the bfloat16
    products run only where oneDNN has them, so the smoke run asks for the two that always can."""
    from bench.studies import cpu_bf16

    out = tmp_path / "runs.json"
    assert cpu_bf16.main(["--no-vllm", "--size", "tiny", "--streams", "3", "--tokens", "4", "--repeats", "1",
                          "--only", "inflight float32", "inflight --dtype bfloat16", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())
    assert [r["system"] for r in runs] == ["inflight float32", "inflight --dtype bfloat16"]
    assert all(r["errors"] == 0 and r["tokens"] == 3 * 4 for r in runs)  # ignore_eos: every token
    assert "| inflight --dtype bfloat16 |" in capsys.readouterr().out
