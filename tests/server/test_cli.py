"""The ``inflight serve`` parser: one flag per EngineConfig field, generated, with the
dataclass default and help; server flags; bad values are usage errors (exit 2)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from inflight.runtime.cli.command import build_parser, engine_config_from_args, main
from inflight.runtime.config import EngineConfig


def parse(*argv: str):
    return build_parser().parse_args(["serve", "--model", "m", *argv])


def test_every_engine_field_has_a_flag_with_the_dataclass_default() -> None:
    args = parse()
    for f in dataclasses.fields(EngineConfig):
        assert getattr(args, f.name) == f.default, f.name
    assert engine_config_from_args(args) == EngineConfig()


def test_help_lists_each_field_with_its_help_text() -> None:
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in text
        assert f.metadata["help"].split()[0] in text


def test_flags_map_onto_fields() -> None:
    args = parse("--max-num-sequences", "8", "--num-kv-blocks", "32", "--no-enable-chunked-context",
                 "--max-model-len", "256", "--max-num-tokens", "256", "--scheduler-policy", "static",
                 "--kv-cache-free-gpu-mem-fraction", "0.5", "--no-enable-prefix-caching")
    config = engine_config_from_args(args)
    assert (config.max_num_sequences, config.num_kv_blocks, config.max_model_len) == (8, 32, 256)
    assert config.enable_chunked_context is False and config.enable_prefix_caching is False
    assert config.scheduler_policy == "static" and config.kv_cache_free_gpu_mem_fraction == 0.5


def test_server_flag_defaults() -> None:
    args = parse()
    assert (args.host, args.port, args.drain_timeout, args.api_key) == ("127.0.0.1", 8000, 30.0, None)
    assert args.served_model_name is None and args.log_level == "info"


@pytest.mark.parametrize("argv", [
    ["--max-num-sequences", "0"],            # EngineConfig validation
    ["--scheduler-policy", "lifo"],          # EngineConfig validation
    ["--max-num-sequences", "four"],         # argparse type
    ["--drain-timeout", "-1"],               # ServerSettings validation
    ["--engine-stall-timeout", "0"],         # ServerSettings validation
    ["--api-key", "same", "--admin-api-key", "same"],  # the admin key must differ
])
def test_bad_values_are_usage_errors(tmp_path, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(tmp_path), *argv])
    assert exc.value.code == 2


def test_missing_model_dir_is_a_usage_error(tmp_path) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", str(tmp_path / "nope")])
    assert exc.value.code == 2


def test_python_dash_m_entry_point() -> None:
    out = subprocess.run([sys.executable, "-m", "inflight.runtime", "serve", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "--max-num-sequences" in out and "--enable-chunked-context" in out and "--api-key" in out


def test_api_key_from_env_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from inflight.runtime.cli.command import server_settings_from_args

    monkeypatch.delenv("INFLIGHT_API_KEY", raising=False)
    assert server_settings_from_args(parse()).api_key is None
    monkeypatch.setenv("INFLIGHT_API_KEY", "from-env")
    assert server_settings_from_args(parse()).api_key == "from-env"
    assert server_settings_from_args(parse("--api-key", "flag")).api_key == "flag"
    assert server_settings_from_args(parse("--served-model-name", "demo")).model_name == "demo"
    assert server_settings_from_args(parse()).model_name == "m"


def test_admin_key_and_hardening_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from inflight.runtime.cli.command import server_settings_from_args
    from inflight.runtime.server import ServerSettings

    monkeypatch.delenv("INFLIGHT_ADMIN_API_KEY", raising=False)
    monkeypatch.delenv("INFLIGHT_API_KEY", raising=False)
    defaults = server_settings_from_args(parse())
    assert defaults.admin_api_key is None  # /admin off unless configured
    for f in dataclasses.fields(ServerSettings):  # one copy of each default
        if f.name not in ("model_name",):
            assert getattr(defaults, f.name) == f.default, f.name
    monkeypatch.setenv("INFLIGHT_ADMIN_API_KEY", "admin-from-env")
    assert server_settings_from_args(parse()).admin_api_key == "admin-from-env"
    settings = server_settings_from_args(parse(
        "--admin-api-key", "admin-flag", "--engine-stall-timeout", "12", "--keepalive-timeout", "5",
        "--request-read-timeout", "7", "--stream-write-timeout", "9"))
    assert settings.admin_api_key == "admin-flag" and settings.engine_stall_timeout_s == 12
    assert (settings.keepalive_timeout_s, settings.request_read_timeout_s, settings.stream_write_timeout_s) == (5, 7, 9)
