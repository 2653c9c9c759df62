"""Smoke tests for the peers section, without installing vLLM or building llama.cpp: the
GGUF-conversion hook on a stand-in converter, the peers' server command lines, the greedy
probe, CPU accounting, run conditions and the oneDNN fp32 check against a real ``inflight
serve``, and the report's targets and conditions."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.bench import peer_section, peers, run_context, serving, workloads
from inflight.bench.client import RequestSpec
from inflight.bench.stats import RunSummary, Spread
from inflight.bench.systems import RunningServer, SystemSpec


def test_convert_hook_answers_gpt2_for_an_unknown_pre_tokenizer(tmp_path: Path) -> None:
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "__init__.py").write_text(
        "class TextModel:\n"
        "    def get_vocab_base_pre(self, tokenizer):\n"
        "        if tokenizer == 'known':\n            return 'llama-bpe'\n"
        "        raise NotImplementedError('BPE pre-tokenizer was not recognized')\n")
    (tmp_path / "convert_hf_to_gguf.py").write_text(
        "import sys\nfrom conversion import TextModel\n"
        "def main():\n    print(TextModel().get_vocab_base_pre(sys.argv[1]))\n"
        "if __name__ == '__main__':\n    main()\n")
    hook = tmp_path / "hook.py"
    hook.write_text(peers.CONVERT_HOOK)
    for arg, expected in (("ours", "gpt-2"), ("known", "llama-bpe")):
        done = subprocess.run([sys.executable, str(hook), str(tmp_path / "convert_hf_to_gguf.py"), arg],
                              capture_output=True, text=True, timeout=60, check=True)
        assert done.stdout.strip() == expected


def test_peer_command_lines(tmp_path: Path) -> None:
    vllm = SystemSpec("v", "vllm", ("--max-model-len", "2048"), exe="/envs/vllm/bin/python")
    server = RunningServer(vllm, tmp_path / "model", tmp_path / "log")
    cmd = server.command()
    assert cmd[:3] == ["/envs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--dtype") + 1] == "float32" and "--max-model-len" in cmd
    llama = SystemSpec("l", "llama-server", ("-np", "16"), exe="/bin/llama-server", model_file="/g/m.gguf")
    cmd = RunningServer(llama, tmp_path / "model", tmp_path / "log").command()
    assert cmd[:3] == ["/bin/llama-server", "-m", "/g/m.gguf"] and cmd[-2:] == ["-np", "16"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("peers-model") / "tiny", size="tiny", eos=False)


def test_probe_and_cores_against_a_real_server(tiny_model: Path, tmp_path: Path) -> None:
    from inflight.runtime.tokenizer import load_tokenizer

    # Enough work (16 x ~80 tokens) that the server's CPU time clears the clock-tick resolution
    # of /proc CPU accounting (10 ms): a few tiny requests once finished in less.
    shape = workloads.WorkloadShape(16, 12, 80, max_prompt=24, max_output=100)
    point = serving.LoadPoint("burst", tuple(workloads.burst(load_tokenizer(tiny_model), shape, seed=1)), True)
    spec = SystemSpec(peer_section.OURS, "inflight", ("--max-num-sequences", "4", "--num-kv-blocks", "128",
                                                       "--max-model-len", "256"))
    plan = serving.ServingPlan(tiny_model, (spec,), (point,), 1, tmp_path, probe=RequestSpec("hello there", 5))
    probes: dict[str, str] = {}
    between: list[bool] = []
    turns: serving.Turns = {}
    raw = serving.run_serving(plan, probes=probes, between=lambda: between.append(True), turns=turns)
    combined = serving.combine_raw(raw)
    assert between == [True]  # once per system and repetition
    assert probes[spec.name]  # a greedy completion came back
    row = combined[spec.name]["burst"]
    assert row["errors"].median == 0
    assert 0.0 < row["cores_used"].median < 64 and not math.isnan(row["cores_used"].median)
    # The conditions: load at the burst's start, steal during it, the server's turn and layout.
    (run,) = raw[spec.name]["burst"]
    assert run.load_1m >= 0.0 and (math.isnan(run.steal_frac) or 0.0 <= run.steal_frac <= 1.0)
    (turn,) = turns[spec.name]
    assert turn.rep == 0 and turn.startup_s > 0.0 and turn.first_request_s > 0.0
    assert turn.layout is not None and len(turn.layout.processes) >= 2  # the front end and the engine core
    if sys.platform.startswith("linux"):
        assert "inflight-core" in turn.layout.processes  # the engine core names itself
    assert turn.layout.threads >= len(turn.layout.processes)
    table = peer_section.Conditions({spec.name: raw[spec.name]["burst"]}, turns).table()
    assert f"| {spec.name} | {len(turn.layout.processes)} (" in table


def test_onednn_fp32_check_against_a_real_server(tiny_model: Path, tmp_path: Path) -> None:
    spec = SystemSpec(peer_section.OURS, "inflight", ("--max-num-sequences", "4", "--num-kv-blocks", "128",
                                                       "--max-model-len", "256"))
    check = peer_section.onednn_fp32_check(spec, tiny_model, tmp_path / "onednn.log")
    # Whatever this CPU's products run on (MKL's sgemm on Intel: no oneDNN primitive at all),
    # anything inflight hands oneDNN must be float32.
    assert check.primitives == 0 or check.float32, check.describe()


def _summary() -> RunSummary:
    return RunSummary(1.0, 1.0, 0.1, 0.1, 0.01, 0.01, 1.0, 1.0, 0.1, 0, 1, 1.0)


def _row(out: float, ttft: float, tpot: float = 0.02) -> dict[str, Spread]:
    values = {"output_tok_s": out, "total_tok_s": 3 * out, "ttft_p50_s": ttft / 2, "ttft_p99_s": ttft,
              "tpot_p50_s": tpot, "tpot_p99_s": 2 * tpot, "e2e_p50_s": 1.0, "e2e_p99_s": 2.0, "gap_p99_s": 0.1,
              "errors": 0.0, "cores_used": 1.5}
    return {k: Spread(v, v, v) for k, v in values.items()}


def test_report_ratios_targets_and_agreement() -> None:
    from inflight.bench.roofline import MatmulRate
    from inflight.bench.suite import SuiteOptions

    placed = peer_section.VLLM_VARIANTS[1][0]  # a better vLLM placement than its defaults
    small = {peer_section.OURS: {"burst": _row(500, 2.0), "poisson@4/s": _row(200, 0.1, 0.015)},
             peer_section.VLLM: {"burst": _row(450, 2.5), "poisson@4/s": _row(200, 0.1, 0.016)},
             placed: {"burst": _row(520, 2.2)},
             peer_section.LLAMA: {"burst": _row(700, 5.0)}}
    medium = {peer_section.OURS: {"burst": _row(60, 9.0)}, peer_section.VLLM: {"burst": _row(80, 8.0)}}
    probes = {"small": {peer_section.OURS: "abc", peer_section.VLLM: "abc", peer_section.LLAMA: "abd"}}
    layout = run_context.ServerLayout(("python3", "python3"), 9, (("0-1", 7), ("0", 1), ("1", 1)))
    runs = [dataclasses.replace(_summary(), load_1m=load, steal_frac=steal) for load, steal in ((0.5, 0.0), (1.25, 0.02))]
    turns = {peer_section.OURS: [serving.ServerTurn(0, 8.2, 0.4, layout), serving.ServerTurn(1, 7.9, 0.3, layout)]}
    conditions = {"small": peer_section.Conditions({peer_section.OURS: runs}, turns)}
    bf16 = run_context.OneDnnCheck(3, ("f32",), ("brg_matmul:avx512_core",), ("bf16",))
    fp32 = {f"small: {peer_section.VLLM}": run_context.OneDnnCheck(14, ("f32",), ("brg_matmul:avx512_core",), ()),
            f"medium: {peer_section.VLLM}": bf16}
    md = "\n".join(peer_section.peers_markdown(
        SuiteOptions(), workloads.WorkloadShape(64, 96, 64), {"small": small, "medium": medium}, probes,
        300.0, MatmulRate(200.0, 2, {1: 100.0, 2: 200.0}, 1024), ["x skipped: no cmake"], [150.0, 200.0, 180.0],
        conditions=conditions, fp32=fp32))
    assert (f"| {peer_section.OURS} | 2 (python3 x2) | 9 (CPUs 0-1: 7; CPUs 0: 1; CPUs 1: 1) | 8 / 8 | 0.40 / 0.30 | "
            "0.50 / 1.25 | 0.0% / 2.0% |") in md
    assert "Conditions of the medium burst" not in md  # none recorded for it
    assert f"- small: {peer_section.VLLM}: 14 compute primitives created, argument types f32" in md
    assert f"- medium: {peer_section.VLLM}: 3 compute primitives created" in md and "**NOT fp32**" in md
    assert "fp32 matmul 200 GFLOP/s at 2 thread(s), the best of 3 samples" in md and "(they ranged 150-200)" in md
    assert f"strongest peer ({peer_section.LLAMA})" in md and f"strongest peer ({peer_section.VLLM})" in md
    assert "small burst: output tok/s >= 1.2x vLLM-CPU's defaults: 1.11x: **MISSED**" in md
    assert f"small burst: output tok/s >= 1.0x vLLM-CPU's best placement here ({placed}): 0.96x: **MISSED**" in md
    assert f"small burst: p99 TTFT no higher than {placed}: 2000 ms vs 2200 ms: **met**" in md
    assert "medium burst: output tok/s >= 1.2x vLLM-CPU's defaults: 0.75x: **MISSED**" in md
    assert f"medium burst: output tok/s >= 1.0x vLLM-CPU's best placement here ({peer_section.VLLM}): 0.75x" in md
    assert "medium burst: total tok/s >= 60% of the matmul roofline: 60%: **met**" in md
    assert f"small, poisson@4/s: TPOT p50 no higher than vLLM-CPU's best ({peer_section.VLLM}): 15.0 ms vs 16.0 ms: " \
           "**met**" in md
    assert f"{peer_section.VLLM} vs inflight: identical" in md
    assert f"{peer_section.LLAMA} vs inflight: DIFFERENT (first difference at character 2)" in md
    assert "- x skipped: no cmake" in md
