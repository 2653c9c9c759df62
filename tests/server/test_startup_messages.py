"""What ``inflight serve`` says at start: a config whose ``architectures`` and ``model_type``
disagree (refused, or served with a warning for transformers' own aliases), a GPU memory fraction
given on the CPU, an unknown flag's suggestion (near misses only), a port in use under ``make run``
(``PORT=``), and start-up errors as JSON lines with ``--log-format json``."""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from inflight.runtime.cli import preflight
from inflight.runtime.cli.command import main
from inflight.runtime.config import EngineConfig
from inflight.runtime.model.spec import (
    MODEL_TYPE_ALIASES,
    POOLING_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    model_type_alias,
    spec_from_hf_config,
)
from tests.server.server_helpers import MODEL_NAME, ServeProcess, wait_until

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def test_disagreeing_architectures_and_model_type_are_refused_with_both_names() -> None:
    from transformers import LlamaConfig, Qwen3Config

    with pytest.raises(ValueError) as info:
        spec_from_hf_config(LlamaConfig(**SMALL, architectures=["Qwen3ForCausalLM"]))
    assert "Qwen3ForCausalLM" in str(info.value) and "'llama'" in str(info.value)
    assert spec_from_hf_config(Qwen3Config(**SMALL, architectures=["Qwen3ForCausalLM"])).arch == "qwen3"
    assert model_type_alias(LlamaConfig(**SMALL)) is None  # no architectures: model_type decides


def test_known_alias_is_served_with_a_warning() -> None:
    from transformers import LlamaConfig

    config = LlamaConfig(**SMALL, architectures=["LlamaForCausalLM"])
    config.model_type = "exaone"  # transformers builds LlamaForCausalLM for exaone too
    assert "LlamaForCausalLM" in model_type_alias(config) and "'exaone'" in model_type_alias(config)
    assert spec_from_hf_config(config).arch == "llama"


def test_alias_table_is_transformers_own() -> None:
    """Each architecture we serve is listed by transformers' auto mappings under its own
    model_type and exactly the aliases :data:`MODEL_TYPE_ALIASES` names (an alias this
    transformers does not know yet, a newer release's, is left out of the comparison)."""
    from transformers.models.auto import configuration_auto, modeling_auto

    listed: dict[str, set[str]] = {}
    for name in dir(modeling_auto):
        if name.endswith("_MAPPING_NAMES"):
            for model_type, classes in getattr(modeling_auto, name).items():
                for cls in classes if isinstance(classes, (list, tuple)) else (classes,):
                    listed.setdefault(cls, set()).add(model_type)
    ours = {**SUPPORTED_ARCHITECTURES, **{a: arch for a, (arch, _) in POOLING_ARCHITECTURES.items()}}
    for cls, arch in ours.items():
        known = {a for a in MODEL_TYPE_ALIASES.get(cls, ()) if a in configuration_auto.CONFIG_MAPPING_NAMES}
        assert listed[cls] == {arch, *known}, cls


def test_memory_fraction_on_the_cpu_says_what_sizes_the_cache() -> None:
    assert preflight.memory_fraction_given(["m", "--gpu-memory-utilization", "0.9"])
    assert preflight.memory_fraction_given(["--kv-cache-free-gpu-mem-fraction=0.5"])
    assert not preflight.memory_fraction_given(["m", "--num-kv-blocks", "8"])
    config = EngineConfig(num_kv_blocks=64, kv_cache_free_gpu_mem_fraction=0.5)
    line = preflight.cpu_memory_fraction_note(SimpleNamespace(resolved={"device": "cpu"}, config=config))
    assert "0.5 has no effect on the CPU" in line and "--num-kv-blocks" in line and "64 blocks of 16 tokens" in line
    assert preflight.cpu_memory_fraction_note(SimpleNamespace(resolved={"device": "cuda"}, config=config)) is None


@pytest.mark.parametrize(("flag", "said"), [
    ("--foo-bar", "unrecognized argument: --foo-bar. "),  # near no flag: no suggestion (was --root-path)
    ("--hots", "--hots (did you mean --host?)"),
    ("--max-model-length", "--max-model-length (did you mean --max-model-len?)"),
])
def test_unknown_flag_suggests_only_near_misses(capsys: pytest.CaptureFixture[str], flag: str, said: str) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "m", flag, "1"])
    assert info.value.code == 2
    assert said in capsys.readouterr().err


def test_usage_errors_are_json_lines_with_log_format_json(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "m", "--log-format", "json", "--foo-bar"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["level"] == "ERROR" and "--foo-bar" in record["message"]


@pytest.fixture()
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_port_in_use_names_port_flag_or_make_variable(
        demo_model_dir: Path, busy_port: int, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["serve", str(demo_model_dir), "--host", "127.0.0.1", "--port", str(busy_port)]
    monkeypatch.delenv(preflight.MAKE_RUN_ENV, raising=False)
    assert main(argv) == 1
    assert capsys.readouterr().err.strip().endswith("choose another with --port")
    monkeypatch.setenv(preflight.MAKE_RUN_ENV, "1")
    assert main(argv) == 1
    assert f"choose another with PORT= on the make command line (e.g. PORT={busy_port + 1})" in capsys.readouterr().err
    assert main([*argv, "--log-format", "json"]) == 1
    record = json.loads(capsys.readouterr().err)
    assert record["level"] == "ERROR" and f"port {busy_port}" in record["message"] and "PORT=" in record["message"]


def test_served_on_the_cpu_with_a_memory_fraction_logs_why_not(demo_model_dir: Path) -> None:
    server = ServeProcess(["--model", str(demo_model_dir), "--served-model-name", MODEL_NAME, "--port", "0",
                           "--host", "127.0.0.1", "--device", "cpu", "--num-kv-blocks", "32", "--max-model-len",
                           "128", "--gpu-memory-utilization", "0.5", "--log-format", "json", "--single-process"])
    try:
        server.wait_ready()
        assert wait_until(lambda: "has no effect on the CPU" in server.log(), 30)
        line = next(json.loads(raw) for raw in server.log().splitlines() if "has no effect on the CPU" in raw)
        assert line["level"] == "WARNING" and "32 blocks" in line["message"]
    finally:
        server.stop()


def test_serve_refuses_a_disagreeing_config_at_start(demo_model_dir: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(demo_model_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:  # main sets up the process's logging: give the rest of the session back its own
        assert main(["serve", str(bad), "--host", "127.0.0.1", "--port", "0", "--log-format", "json"]) == 1
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    record = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert record["level"] == "ERROR" and "Qwen3ForCausalLM" in record["message"]
    assert f"model_type is '{config['model_type']}'" in record["message"]
