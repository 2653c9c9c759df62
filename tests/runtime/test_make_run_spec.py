"""``make run SPEC=1``: the serve command the Makefile runs carries a speculative config that the
server's own flag parser and EngineConfig accept, and plain ``make run`` carries none."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from inflight.runtime.cli import vllm_aliases as cli_vllm
from inflight.runtime.cli.command import build_parser, engine_config_from_args
from inflight.runtime.spec_decode.speculative import parse_speculative_config

ROOT = Path(__file__).resolve().parents[2]


def _serve_argv(*make_args: str) -> list[str]:
    """The ``inflight serve ...`` arguments of the run target's recipe, printed by ``make -n`` (nothing runs)."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "run", *make_args], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    lines = [line for line in out.splitlines() if " -m inflight.runtime serve " in line]
    assert len(lines) == 1, out
    argv = shlex.split(lines[0])
    return argv[argv.index("serve"):]


def _engine_config(argv: list[str]):  # noqa: ANN202 - EngineConfig
    args, extras = build_parser().parse_known_args(cli_vllm.normalize_argv(argv))
    assert extras == []
    assert cli_vllm.check_given(args)[1] is None  # no refusal
    return engine_config_from_args(args)


def test_spec_1_serves_the_makefiles_ngram_config() -> None:
    argv = _serve_argv("SPEC=1")
    config = _engine_config(argv)
    assert config.speculative_config is not None
    spec = parse_speculative_config(config.speculative_config)
    assert spec is not None and spec.method == "ngram"
    line = re.search(r"^SPEC_CONFIG\s*:=\s*(\{.*\})\s*$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert line is not None
    assert json.loads(config.speculative_config) == json.loads(line.group(1))
    # the measured batch of 32 (docs/tuning.md) runs without speculation; batch 1 speculates
    assert 1 < spec.disable_by_batch_size <= 32
    # one pass of the fused few-row kernel takes a verify's k + 1 rows on an AVX-512 build (8 rows)
    assert spec.num_speculative_tokens + 1 <= 8


def test_plain_run_and_other_spec_values_serve_without_speculation() -> None:
    for make_args in ((), ("SPEC=0",), ("SPEC=",)):
        argv = _serve_argv(*make_args)
        assert "--speculative-config" not in argv
        assert _engine_config(argv).speculative_config is None


def test_spec_1_keeps_a_users_run_args() -> None:
    argv = _serve_argv("SPEC=1", "RUN_ARGS=--num-kv-blocks 512")
    config = _engine_config(argv)
    assert config.num_kv_blocks == 512 and config.speculative_config is not None
