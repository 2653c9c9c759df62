"""What a vLLM user tries on day one: --version, vLLM's flag spellings, a positional model,
clear one-line refusals (hub id, port in use, a KV cache smaller than one sequence), the
log format, and the stats line."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from inflight import __version__
from inflight.runtime.cli.command import build_parser, engine_config_from_args, main
from inflight.runtime.cli.preflight import port_problem
from inflight.runtime.core.input_checks import kv_cache_problem
from inflight.runtime.core.stats_log import stats_line
from inflight.runtime.logs import configure_logging
from inflight.runtime.outputs import EngineStats


def test_version_flag_matches_the_package() -> None:
    out = subprocess.run([sys.executable, "-m", "inflight.runtime", "--version"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == f"inflight {__version__}"
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert f'version = "{__version__}"' in pyproject


def test_vllm_spellings_and_positional_model() -> None:
    args = build_parser().parse_args([
        "serve", "some/dir", "--max-num-seqs", "7", "--max-num-batched-tokens", "512",
        "--gpu-memory-utilization", "0.8", "--no-enable-prefix-caching",
    ])
    config = engine_config_from_args(args)
    assert args.model_path == "some/dir" and config.max_num_sequences == 7 and config.max_num_tokens == 512
    assert config.kv_cache_free_gpu_mem_fraction == 0.8 and config.enable_prefix_caching is False


def test_two_different_models_or_none_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["serve", "a", "--model", "b"], ["serve"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert "usage: inflight serve" in capsys.readouterr().err


def test_hub_id_gets_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "HuggingFaceTB/SmolLM2-135M-Instruct"])
    err = capsys.readouterr().err
    assert "never downloads models" in err and "`hf download HuggingFaceTB/SmolLM2-135M-Instruct" in err


def test_port_in_use_is_one_line_before_loading(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert "already in use" in (port_problem("127.0.0.1", port) or "")
        assert main(["serve", str(llama_dir), "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"port {port} on 127.0.0.1 is already in use" in err
    assert port_problem("127.0.0.1", 0) is None


def test_kv_cache_must_hold_one_full_length_sequence() -> None:
    def engine(blocks: int) -> SimpleNamespace:
        return SimpleNamespace(config=SimpleNamespace(num_kv_blocks=blocks, block_size=16), max_model_len=1024)

    assert kv_cache_problem(engine(64)) is None
    problem = kv_cache_problem(engine(63)) or ""
    assert "holds 1008 tokens" in problem and "--num-kv-blocks" in problem


def test_log_formats(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info", "text")
        logging.getLogger("inflight.test").info("hello %s", "there")
        configure_logging("info", "json")
        logging.getLogger("inflight.test").info("hello json")
        with pytest.raises(ValueError, match="json or text"):
            configure_logging("info", "yaml")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].endswith("INFO inflight.test: hello there")
    assert lines[1].startswith("{") and '"message": "hello json"' in lines[1]


def test_stats_line() -> None:
    stats = EngineStats(num_running=3, num_waiting=2, num_kv_blocks=100, num_used_kv_blocks=25,
                        num_preemptions=0, prefix_cache_queries=10, prefix_cache_hits=4,
                        num_prompt_tokens=0, num_generation_tokens=0, num_tokens_last_step=0,
                        num_steps=0, max_num_sequences=8)
    line = stats_line(stats, 120.0, 33.3)
    assert line == ("engine: running 3 reqs, waiting 2 reqs, KV cache usage 25.0%, prefix cache hit rate "
                    "40.0%, prompt 120.0 tok/s, generation 33.3 tok/s")


def test_broken_tokenizer_is_reported_before_weights_load(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "model"
    shutil.copytree(llama_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "model.safetensors").write_bytes(b"")  # loading weights would fail differently
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert main(["serve", str(broken), "--port", "0"]) == 1
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    assert f"the tokenizer in {broken} does not load" in capsys.readouterr().err


def test_too_small_kv_cache_is_refused_before_weights_load(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert main(["serve", str(llama_dir), "--port", "0", "--num-kv-blocks", "2"]) == 1
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
    err = capsys.readouterr().err
    assert "the KV cache holds 32 tokens, fewer than one full-length sequence (max_model_len 1024)" in err
    assert "loading weights" not in err
