"""Smoke tests for ``make compat`` without installing lm-eval or guidellm: the environments'
install commands, the lm-eval tasks, command lines and result reading (on files shaped as
lm-eval 0.4 writes them), guidellm's command line and headline figures, the table; and, slow,
the openai checks through the runner against a real ``inflight serve`` of a tiny model, with
this environment's openai client standing in for the openai environment."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from bench.compat import envs as compat_envs
from bench.compat import guidellm_run as compat_guidellm
from bench.compat import lm_eval_run as compat_lm_eval
from bench.compat import run as compat
from bench.compat.run import CompatRow

# ---- environments --------------------------------------------------------------------------


def test_install_commands_put_torch_first_through_the_install_step(tmp_path: Path) -> None:
    cmds = compat_envs.install_commands(tmp_path, compat_envs.LM_EVAL, base_python="/usr/bin/python3")
    py = str(tmp_path / "lm-eval" / "bin" / "python")
    assert cmds[0] == ["/usr/bin/python3", "-m", "venv", str(tmp_path / "lm-eval")]
    assert cmds[2] == [py, str(compat_envs.INSTALL_TORCH), "--python", py]
    assert compat_envs.INSTALL_TORCH.is_file()
    assert cmds[-1] == [py, "-m", "pip", "install", "--quiet", "lm-eval[api,hf]==0.4.13"]
    openai_cmds = compat_envs.install_commands(tmp_path, compat_envs.OPENAI)
    assert not any(str(compat_envs.INSTALL_TORCH) in c for c in openai_cmds)  # the client needs no torch
    assert {t.name for t in compat_envs.TOOLS} == {"lm-eval", "guidellm", "openai"}
    assert all("==" in t.requirement for t in compat_envs.TOOLS)  # pinned: a table means the same next time


def test_an_environment_made_for_another_pin_is_not_installed(tmp_path: Path) -> None:
    tool = compat_envs.OPENAI
    assert not compat_envs.is_installed(tmp_path, tool)
    (tmp_path / "openai").mkdir()
    (tmp_path / "openai" / ".inflight-compat-installed").write_text("openai==1.0.0\n")
    assert not compat_envs.is_installed(tmp_path, tool)
    (tmp_path / "openai" / ".inflight-compat-installed").write_text(tool.requirement + "\n")
    assert compat_envs.is_installed(tmp_path, tool)


# ---- lm-eval -------------------------------------------------------------------------------


def test_local_tasks_are_valid_yaml_with_answers_in_place(tmp_path: Path) -> None:
    folder = compat_lm_eval.write_tasks(tmp_path / "tasks", 6)
    mc = yaml.safe_load((folder / f"{compat_lm_eval.MC_TASK}.yaml").read_text())
    gen = yaml.safe_load((folder / f"{compat_lm_eval.GEN_TASK}.yaml").read_text())
    assert mc["output_type"] == "multiple_choice" and gen["output_type"] == "generate_until"
    assert gen["generation_kwargs"]["until"] == ["\n", "."] and gen["generation_kwargs"]["do_sample"] is False
    docs = [json.loads(line) for line in Path(mc["dataset_kwargs"]["data_files"]["test"]).read_text().splitlines()]
    assert len(docs) == 6
    for doc, (country, capital) in zip(docs, compat_lm_eval.CAPITALS, strict=False):
        assert country in doc["question"] and doc["choices"][doc["answer"]] == capital
        assert len(set(doc["choices"])) == 4
    with pytest.raises(ValueError, match="num_docs must be between 1 and"):
        compat_lm_eval.write_tasks(tmp_path / "x", 0)


def test_lm_eval_command_lines(tmp_path: Path) -> None:
    hf = compat_lm_eval.hf_command("lm_eval", Path("/m"), Path("/t"), Path("/o"))
    assert hf[:4] == ["lm_eval", "run", "--model", "hf"]
    assert hf[hf.index("--model_args") + 1] == "pretrained=/m,dtype=float32"
    ours = compat_lm_eval.local_completions_command("lm_eval", "smol", "http://127.0.0.1:9", Path("/m"), Path("/t"),
                                                    Path("/o"))
    args = dict(kv.split("=", 1) for kv in ours[ours.index("--model_args") + 1].split(","))
    assert ours[3] == "local-completions" and args["base_url"] == "http://127.0.0.1:9/v1/completions"
    assert args["model"] == "smol" and args["tokenizer"] == "/m" and args["tokenized_requests"] == "True"
    for cmd in (hf, ours):  # same tasks, same samples logged, so the two can be compared item by item
        assert cmd[cmd.index("--tasks") + 1] == f"{compat_lm_eval.MC_TASK},{compat_lm_eval.GEN_TASK}"
        assert "--log_samples" in cmd and cmd[cmd.index("--include_path") + 1] == "/t"


def _fake_lm_eval_output(out: Path, acc: float, em: float, lls: list[list[float]], gens: list[str]) -> Path:
    """Files as ``lm_eval run --output_path out --log_samples`` writes them."""
    folder = out / "__models__m"
    folder.mkdir(parents=True)
    stamp = "2026-11-24T17-05-11.615849"
    (folder / f"results_{stamp}.json").write_text(json.dumps({"results": {
        compat_lm_eval.MC_TASK: {"acc,none": acc, "alias": "mc"},
        compat_lm_eval.GEN_TASK: {"exact_match,none": em, "alias": "gen"}}}))
    (folder / f"samples_{compat_lm_eval.MC_TASK}_{stamp}.jsonl").write_text("".join(
        json.dumps({"doc_id": i, "resps": [[[str(ll), "False"]] for ll in doc]}) + "\n" for i, doc in enumerate(lls)))
    (folder / f"samples_{compat_lm_eval.GEN_TASK}_{stamp}.jsonl").write_text("".join(
        json.dumps({"doc_id": i, "resps": [[g]], "filtered_resps": [g]}) + "\n" for i, g in enumerate(gens)))
    return out


def test_read_and_compare_two_runs(tmp_path: Path) -> None:
    hf = compat_lm_eval.read_run(_fake_lm_eval_output(tmp_path / "hf", 0.5, 1.0, [[-1.0, -2.0], [-3.0, -0.5]],
                                                      [" Paris", " Berlin"]))
    ours = compat_lm_eval.read_run(_fake_lm_eval_output(tmp_path / "ours", 0.5, 1.0,
                                                        [[-1.00002, -2.0], [-3.0, -0.5]], [" Paris", " Berlin"]))
    assert hf.loglikelihoods[(1, 1)] == -0.5 and hf.generations[1] == " Berlin"
    same = compat_lm_eval.compare(hf, ours)
    assert same.max_loglikelihood_diff == pytest.approx(2e-5) and same.loglikelihood_ok and same.generate_ok
    assert same.num_docs == 2 and same.num_loglikelihoods == 4
    worse = compat_lm_eval.compare(hf, compat_lm_eval.LmEvalRun(0.0, 0.5, {(0, 0): -1.0}, {0: " Paris", 1: " Bonn"}))
    assert worse.max_loglikelihood_diff == float("inf") and not worse.loglikelihood_ok
    assert worse.same_generations == 1 and not worse.generate_ok
    with pytest.raises(FileNotFoundError, match="lm-eval wrote no results_"):
        compat_lm_eval.read_run(tmp_path / "empty")


# ---- guidellm ------------------------------------------------------------------------------


def test_guidellm_command_line() -> None:
    load = compat_guidellm.GuidellmLoad(num_requests=8, concurrency=2, prompt_tokens=16, output_tokens=4)
    cmd = compat_guidellm.command("guidellm", "http://127.0.0.1:9", "smol", Path("/m"), Path("/o.json"), load)
    opts = {cmd[i]: cmd[i + 1] for i in range(2, len(cmd) - 1) if cmd[i].startswith("--")}
    assert cmd[:2] == ["guidellm", "run"] and cmd[-1] == "--disable-progress"
    assert opts["--backend"] == "kind=openai_http,target=http://127.0.0.1:9,model=smol"
    assert opts["--profile"] == "kind=concurrent,streams=2"
    assert opts["--constraint"] == "kind=max_requests,count=8"
    assert opts["--data"] == "kind=synthetic_text,prompt_tokens=16,output_tokens=4"
    assert opts["--tokenizer"] == "kind=hf_auto,model=/m" and opts["--output"] == "kind=json,path=/o.json"


def _stat(mean: float, median: float) -> dict:
    return {"successful": {"mean": mean, "median": median}}


def test_guidellm_headline_from_its_report() -> None:
    report = {"benchmarks": [{"metrics": {
        "request_totals": {"successful": 32, "errored": 0, "incomplete": 0, "total": 32},
        "requests_per_second": _stat(1.2, 1.1), "output_tokens_per_second": _stat(39.0, 40.0),
        "time_to_first_token_ms": _stat(600.0, 578.0), "inter_token_latency_ms": _stat(80.0, 83.4),
        "request_latency": _stat(3.0, 3.14)}}]}
    figures = compat_guidellm.headline(report)
    assert figures.ok and figures.requests_per_s == 1.2 and figures.ttft_p50_ms == 578.0
    text = figures.describe(compat_guidellm.GuidellmLoad())
    assert text.startswith("32/32 ok, 0 errors; 1.20 req/s, 39 output tok/s, TTFT p50 578 ms, ITL p50 83.4 ms")
    report["benchmarks"][0]["metrics"]["request_totals"]["errored"] = 1
    assert not compat_guidellm.headline(report).ok


# ---- the table -----------------------------------------------------------------------------


def test_table_has_one_row_per_check_and_counts_passes() -> None:
    rows = [CompatRow("openai 3.54.0", "models.retrieve", "id 'x'", True),
            CompatRow("guidellm 0.8.1", "install", "failed | see log\nmore", False)]
    table = compat.build_table(rows, "Model: demo")
    lines = table.splitlines()
    assert lines[0] == "Model: demo" and lines[2] == "| client | check | result | ok |"
    assert "| openai 3.54.0 | models.retrieve | id 'x' | PASS |" in lines
    assert "| guidellm 0.8.1 | install | failed \\| see log\\nmore | FAIL |" in lines  # one cell, one line
    assert lines[-1] == "1/2 checks passed."


def test_lm_eval_rows_say_what_was_compared() -> None:
    comparison = compat_lm_eval.LmEvalComparison(24, 96, 0.958, 0.958, 2.8e-5, 0.875, 0.875, 24)
    ll, gen = compat.lm_eval_rows(comparison, (19.0, 22.0))
    assert ll.ok and "acc 0.958 vs 0.958" in ll.result and "max loglikelihood difference 2.8e-05" in ll.result
    assert gen.ok and "identical generations 24/24" in gen.result


def test_server_command_serves_under_the_given_name(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    cmd = compat.server_command(tmp_path, "smol", 4321)
    assert cmd[:5] == [sys.executable, "-m", "inflight.runtime", "serve", str(tmp_path)]
    assert cmd[cmd.index("--served-model-name") + 1] == "smol" and cmd[cmd.index("--port") + 1] == "4321"
    assert cmd[cmd.index("--max-model-len") + 1] == "1024"  # never past what the model supports


# ---- the openai checks through the runner, against a real server ---------------------------


@pytest.mark.slow
def test_openai_checks_through_the_runner(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    from inflight.runtime.demo.model import make_demo_model

    model_dir = make_demo_model(tmp_path / "tiny", size="tiny", eos=False)
    work = tmp_path / "work"
    python = compat_envs.env_python(work, compat_envs.OPENAI)
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")  # this venv stands in for the openai one
    python.chmod(0o755)
    with compat.CompatServer(model_dir, "tiny", tmp_path / "server.log") as server:
        rows = compat.run_openai(work, server)
    assert [r.check for r in rows] == ["chat.completions.create", "chat.completions.create(stream=True)",
                                       "models.retrieve"]
    assert all(r.ok for r in rows), rows
    assert rows[0].tool.startswith("openai ") and "same text as the plain call" in rows[1].result
