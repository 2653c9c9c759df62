"""What ``inflight serve`` checks before any weight loads: the port's range and the host (exit 2,
one line), a --max-model-len past the model's config (exit 1, one line), and --tokenizer /
--chat-template, served through an overlay of the model directory that every loader reads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inflight.runtime.cli.command import main
from inflight.runtime.cli.preflight import port_problem
from inflight.runtime.cli.serving_dir import read_chat_template, serving_dir
from inflight.runtime.tokenizer import load_tokenizer

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>>{% endif %}"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("INFLIGHT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize(("argv", "said"), [
    (["--port", "99999"], "argument --port: '99999' is not a port: use 1..65535 (0: any free port)"),
    (["--port", "-5"], "argument --port: '-5' is not a port"),
    (["--port", "http"], "argument --port: 'http' is not a port"),
    (["--host", "no-such-host.invalid", "--port", "0"], "--host no-such-host.invalid: cannot resolve it"),
    (["--tokenizer", "org/tokenizer"], "--tokenizer org/tokenizer: no such directory"),
])
def test_bad_address_or_tokenizer_is_a_usage_error_before_loading(
    llama_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(llama_dir), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and said in err and "loading weights" not in err and "loading model" not in err
    assert err.strip().splitlines()[-1].startswith("inflight serve: error: ")


def test_port_problem_never_raises_for_a_bad_port() -> None:
    assert "not a port" in (port_problem("127.0.0.1", 99999) or "")
    assert "not a port" in (port_problem("127.0.0.1", -5) or "")


def test_max_model_len_past_the_config_is_refused_before_weights_load(
    llama_dir: Path, capsys: pytest.CaptureFixture[str], logging_restored: None
) -> None:
    limit = json.loads((llama_dir / "config.json").read_text())["max_position_embeddings"]
    assert main(["serve", str(llama_dir), "--port", "0", "--max-model-len", str(limit + 1)]) == 1
    err = capsys.readouterr().err
    assert f"--max-model-len {limit + 1} is longer than the model supports ({limit}, its max_position_embeddings" in err
    assert "loading weights" not in err and "loading model" not in err


def test_chat_template_from_a_string_or_a_file(tmp_path: Path) -> None:
    assert read_chat_template("{{ x }}\\n") == "{{ x }}\n"  # escapes decoded, as vLLM does
    (tmp_path / "t.jinja").write_text("{{ y }}\\n")
    assert read_chat_template(str(tmp_path / "t.jinja")) == "{{ y }}\\n"  # a file is taken as it is
    with pytest.raises(ValueError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_given_chat_template_is_the_one_the_tokenizer_applies(llama_dir: Path, tmp_path: Path) -> None:
    served = serving_dir(llama_dir, None, TEMPLATE, root=tmp_path)
    assert served != llama_dir and served.parent == tmp_path / "serving"
    messages = [{"role": "user", "content": "hi"}]
    text = load_tokenizer(served).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "[user] hi\n>>"
    assert load_tokenizer(llama_dir).apply_chat_template(messages, tokenize=False) != "[user] hi\n"
    assert serving_dir(llama_dir, None, TEMPLATE, root=tmp_path) == served  # built once
    assert serving_dir(llama_dir) == llama_dir  # nothing to overlay


def test_tokenizer_comes_from_the_tokenizer_dir(llama_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "tokenizer"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(llama_dir / name, other / name)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 12345}))
    (other / "chat_template.jinja").write_text(TEMPLATE)
    served = serving_dir(llama_dir, other, None, root=tmp_path)
    tokenizer = load_tokenizer(served)
    assert tokenizer.model_max_length == 12345 and tokenizer.chat_template == TEMPLATE
    assert (served / "config.json").resolve() == (llama_dir / "config.json").resolve()


def test_a_template_that_does_not_render_is_refused_at_start(
    llama_dir: Path, cache: Path, capsys: pytest.CaptureFixture[str], logging_restored: None
) -> None:
    assert main(["serve", str(llama_dir), "--port", "0", "--chat-template", "{% for m in messages %}"]) == 1
    err = capsys.readouterr().err
    assert "--chat-template: the template does not render" in err and "loading weights" not in err
