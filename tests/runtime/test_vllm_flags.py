"""vLLM's ``serve`` flags: every row of ``vllm_flags`` does in the parser what the table in
docs/from-vllm.md says (alias: the same parse as the inflight flag; notice: accepted with a
line; refused: a usage error naming why), an unknown flag gets "did you mean" and the doc,
abbreviations are off, and ``--help`` states each default once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from inflight.runtime.cli import vllm_flags
from inflight.runtime.cli.command import build_parser, engine_config_from_args, main
from inflight.runtime.cli.vllm_aliases import check_given, normalize_argv
from inflight.runtime.cli.vllm_flags import ALIAS, FLAGS, NOTICE, ONLY, REFUSED, VllmFlag

DOC = Path(__file__).resolve().parents[2] / "docs" / "from-vllm.md"
# A valid value for each inflight flag an alias names (others take "7").
EXAMPLES = {"--model": "other", "--tokenizer": "tok", "--chat-template": "{{ messages }}", "--host": "0.0.0.0",
            "--served-model-name": "served", "--api-key": "key", "--log-level": "warning", "--dtype": "bfloat16",
            "--access-log-exclude": "/health", "--scheduler-policy": "priority", "--speculative-config":
            '{"method": "ngram"}', "--kv-cache-free-gpu-mem-fraction": "0.5", "--drain-timeout": "5",
            "--tool-call-parser": "hermes", "--override-generation-config": '{"temperature": 0.5}',
            "--lora-modules": "a=/adapters/a"}
VALUES = {0: [], 1: ["x"], "?": [], "+": ["a", "b"]}


def parse(*argv: str):
    return build_parser().parse_args(["serve", "m", *argv])


def _spellings() -> list[tuple[str, VllmFlag]]:
    return [(name, flag) for flag in FLAGS for name in (*flag.names, flag.negative) if name is not None]


def _opposite(flag: str) -> str:
    return "--" + flag[5:] if flag.startswith("--no-") else "--no-" + flag[2:]


@pytest.mark.parametrize(("name", "flag"), _spellings(), ids=[n for n, _ in _spellings()])
def test_every_vllm_spelling_does_what_the_table_says(name: str, flag: VllmFlag) -> None:
    if flag.kind == ALIAS:
        target = flag.text if name in flag.names else _opposite(flag.text)
        value = [] if flag.nargs == 0 else [EXAMPLES.get(flag.text, "7")]
        assert vars(parse(name, *value)) == vars(parse(target, *value)), f"{name} is not {target}"
        return
    if flag.kind == ONLY:
        notices, refusal = check_given(parse(name, flag.values[0]))
        assert refusal is None and len(notices) == 1 and name in notices[0] and flag.note in notices[0]
        notices, refusal = check_given(parse(name, "something-else"))
        assert refusal is not None and name in refusal and flag.text in refusal
        return
    notices, refusal = check_given(parse(name, *VALUES[flag.nargs]))
    if flag.kind == REFUSED and name != flag.negative:
        assert refusal is not None and refusal.startswith(name) and flag.text in refusal
    else:
        assert flag.kind in (NOTICE, REFUSED) and refusal is None
        assert len(notices) == 1 and name in notices[0] and flag.text in notices[0]


def test_the_table_covers_vllms_release_and_its_doc_is_generated() -> None:
    # vLLM 0.32.0's `vllm serve`: 317 parser actions, --help left out (tests/runtime/data/vllm_0_32_serve_flags.txt)
    assert len(FLAGS) - len(vllm_flags.LEGACY) == 316
    doc = DOC.read_text()
    assert doc == vllm_flags.with_tables(doc), "docs/from-vllm.md is stale: python -m inflight.runtime.cli.vllm_flags"
    for name, _ in _spellings():
        assert f"`{name}`" in doc


def test_vllm_spellings_of_values_and_flags() -> None:
    assert engine_config_from_args(parse("--dtype", "half")).dtype == "float16"
    assert engine_config_from_args(parse("--dtype", "float")).dtype == "float32"
    assert parse("--uvicorn-log-level", "trace").log_level == "debug"
    config = engine_config_from_args(parse("--no-enable-chunked-prefill", "--num-gpu-blocks-override", "9",
                                           "--scheduling-policy", "priority", "--enforce-eager"))
    assert (config.enable_chunked_context, config.num_kv_blocks, config.scheduler_policy) == (False, 9, "priority")
    assert config.enforce_eager is True
    args = parse("--disable-log-stats", "--disable-log-requests", "--shutdown-timeout", "4")
    assert (args.stats_log, args.access_log, args.drain_timeout) == (False, False, 4.0)
    assert parse("--disable-access-log-for-endpoints", "/health,/ready").access_log_exclude == "/health,/ready"
    assert parse().stats_log is True and parse().access_log is True
    assert normalize_argv(["--max_model_len=8", "--max_num_seqs", "a_b"]) == ["--max-model-len=8", "--max-num-seqs", "a_b"]


@pytest.mark.parametrize(("argv", "said"), [
    (["--kv-cache-memory-bytes", "1000"], "--kv-cache-memory-bytes 1000: refused"),
    (["--quantization-config", "{}"], "--quantization-config {}: refused"),
    (["--allowed-origins", '["*"]'], "no CORS headers"),
])
def test_a_refused_vllm_flag_is_a_usage_error_before_anything_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path / "not-even-a-model"), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and said in err and "docs/from-vllm.md" in err and "usage: inflight serve" in err


def test_a_quantization_method_we_lack_is_a_usage_error_naming_ours(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(tmp_path / "not-even-a-model"), "-q", "awq"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "quantization must be one of auto, none, gguf, compressed-tensors" in err


@pytest.mark.parametrize(("argv", "said"), [
    (["--max-model", "512"], "--max-model (did you mean --max-model-len?)"),      # no abbreviations
    (["--max-num-seq", "4"], "--max-num-seq (did you mean --max-num-seqs?)"),
    (["--enable-chunk-prefill"], "did you mean --enable-chunked-prefill?"),
    (["--no-such-flag=3"], "unrecognized argument: --no-such-flag"),
])
def test_unknown_flags_get_serves_usage_a_suggestion_and_the_doc(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "m", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and said in err
    assert err.startswith("usage: inflight serve") and "docs/from-vllm.md" in err


def test_help_states_each_default_once_and_hides_vllms_other_flags() -> None:
    text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    entries = re.split(r"\n(?=  -)", text.split("\nserver:", 1)[1])
    assert len(entries) > 30
    for entry in entries:
        assert entry.lower().count("default") <= 1, entry
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: )" not in text
    assert "--num-gpu-blocks-override" in text and "--trust-remote-code" not in text
    assert "docs/from-vllm.md" in text
