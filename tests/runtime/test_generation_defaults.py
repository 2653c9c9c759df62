"""vLLM's ``--generation-config`` / ``--override-generation-config``: which sampling defaults a
model directory's ``generation_config.json`` gives, what ``vllm`` and a directory change, what
the override replaces, and that bad values are refused naming the file and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.runtime.generation_defaults import (
    SamplingDefaults,
    load_sampling_defaults,
    parse_override,
    source_problem,
)

MODEL_FILE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9,
              "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 512, "min_p": None}


def _model_dir(root: Path, config: dict | None = MODEL_FILE) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (root / "generation_config.json").write_text(json.dumps(config))
    return root


def test_auto_takes_vllms_sampling_fields_from_the_model_directory(tmp_path: Path) -> None:
    defaults = load_sampling_defaults("auto", _model_dir(tmp_path / "m"))
    assert defaults.values() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    assert defaults.ignored == ("max_new_tokens",)  # vLLM caps max_tokens with it; said, not applied
    line = defaults.describe()
    assert "temperature=0.6" in line and "generation_config.json" in line and "not applied: max_new_tokens" in line


def test_vllm_ignores_the_file_and_a_directory_replaces_it(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m")
    assert load_sampling_defaults("vllm", model).values() == {}
    assert "--generation-config vllm" in load_sampling_defaults("vllm", model).describe()
    other = _model_dir(tmp_path / "other", {"temperature": 0.2})
    assert load_sampling_defaults(str(other), model).values() == {"temperature": 0.2}


def test_a_model_without_the_file_or_its_sampling_fields_gets_openais_defaults(tmp_path: Path) -> None:
    assert load_sampling_defaults("auto", _model_dir(tmp_path / "none", None)).values() == {}
    # what `make run`'s converted SmolLM2 and the demo models carry: token ids only
    ids_only = _model_dir(tmp_path / "ids", {"bos_token_id": 1, "eos_token_id": 2})
    defaults = load_sampling_defaults("auto", ids_only)
    assert defaults.values() == {} and defaults.ignored == () and "OpenAI's" in defaults.describe()


def test_the_override_replaces_the_files_fields_even_with_vllm(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m")
    override = parse_override('{"temperature": 0.5, "min_p": 0.1, "seed": 3}')
    defaults = load_sampling_defaults("auto", model, override)
    assert defaults.values() == {"temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1,
                                 "repetition_penalty": 1.05}
    assert "seed (--override-generation-config)" in defaults.ignored
    assert load_sampling_defaults("vllm", model, {"temperature": 0.5}).values() == {"temperature": 0.5}


def test_a_value_out_of_bounds_names_the_file_the_field_and_the_ways_out(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", {"temperature": 3.0})
    with pytest.raises(ValueError) as exc:
        load_sampling_defaults("auto", model)
    text = str(exc.value)
    assert "generation_config.json" in text and "temperature must be in [0, 2]" in text
    assert "--override-generation-config" in text and "--generation-config vllm" in text
    assert load_sampling_defaults("auto", model, {"temperature": 1.0}).temperature == 1.0  # the override mends it
    (model / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_sampling_defaults("auto", model)


@pytest.mark.parametrize(("text", "said"), [
    ("{not json", "not JSON"),
    ("[0.5]", "must be a JSON object"),
    ('{"temperature": 9}', "temperature must be in [0, 2]"),
    ('{"top_k": 2.5}', "top_k must be an integer"),
])
def test_a_bad_override_is_refused(text: str, said: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_override(text)
    assert said in str(exc.value)


def test_source_problems(tmp_path: Path) -> None:
    assert source_problem("auto") is None and source_problem("vllm") is None
    assert "not auto, vllm or a directory" in (source_problem(str(tmp_path / "nope")) or "")
    assert "has no generation_config.json" in (source_problem(str(tmp_path)) or "")
    assert source_problem(str(_model_dir(tmp_path / "m"))) is None


def test_defaults_are_checked_like_request_values() -> None:
    assert SamplingDefaults(temperature=0.0).values() == {"temperature": 0.0}  # 0 is a value, not unset
    assert SamplingDefaults().values() == {}
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingDefaults(top_p=0.0)
