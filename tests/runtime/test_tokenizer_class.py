"""A tokenizer loaded with the class ``AutoTokenizer`` chose (what the server's front end does,
told the class by its engine-core process) is the tokenizer ``AutoTokenizer`` loads: the same
class, ids, text, special tokens and template, over the classes real checkpoints declare and
the model types whose declared class ``AutoTokenizer`` overrides. And loading that way
imports no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from inflight.runtime.tokenizer import load_tokenizer, tokenizer_class_path

TEXTS = ["hello world", "  leading spaces\tand tabs\n", "def f(x):\n    return x ** 2  # ünïcödé 🙂",
         "<|im_start|>user\nhi<|im_end|>", ""]  # fmt: skip
DECLARED = ["TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizerFast", "Qwen2Tokenizer",
            "GPT2Tokenizer", "GemmaTokenizer", None]  # fmt: skip
MODEL_TYPES = ["llama", "qwen2", "mistral"]


def _variant(src: Path, dest: Path, declared: str | None, model_type: str) -> Path:
    shutil.copytree(src, dest)
    tokenizer_config = json.loads((dest / "tokenizer_config.json").read_text())
    tokenizer_config.pop("tokenizer_class", None)
    if declared is not None:
        tokenizer_config["tokenizer_class"] = declared
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    return dest


def _behaviour(tokenizer: Any) -> list[Any]:
    def outcome(call: Any) -> Any:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - a tokenizer that fails must fail alike
            return f"{type(exc).__name__}: {exc}"

    messages = [{"role": "user", "content": "hi"}]
    return [type(tokenizer), tokenizer.special_tokens_map, len(tokenizer), tokenizer.chat_template,
            outcome(lambda: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)),
            *(outcome(lambda t=t: tokenizer.encode(t)) for t in TEXTS),
            *(outcome(lambda t=t: tokenizer.decode(tokenizer.encode(t, add_special_tokens=False))) for t in TEXTS)]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("declared", DECLARED, ids=str)
def test_loading_with_the_chosen_class_is_loading_with_auto_tokenizer(
    llama_dir: Path, tmp_path: Path, declared: str | None, model_type: str
) -> None:
    model_dir = _variant(llama_dir, tmp_path / "model", declared, model_type)
    auto = load_tokenizer(model_dir)
    direct = load_tokenizer(model_dir, tokenizer_class_path(auto))
    assert _behaviour(direct) == _behaviour(auto)


def test_the_chosen_class_is_the_one_auto_tokenizer_picks_over_the_declared_one(llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _variant(llama_dir, tmp_path / "model", "GPT2Tokenizer", "qwen2")
    assert tokenizer_class_path(load_tokenizer(model_dir)) == "transformers.models.qwen2.tokenization_qwen2:Qwen2Tokenizer"


def test_loading_with_the_class_imports_no_torch(llama_dir: Path) -> None:
    path = tokenizer_class_path(load_tokenizer(llama_dir))
    probe = ("import sys\n"
             "from inflight.runtime.tokenizer import load_tokenizer\n"
             f"ids = load_tokenizer({str(llama_dir)!r}, {path!r}).encode('hello world')\n"
             "print(len(ids), 'torch' in sys.modules, 'transformers.configuration_utils' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == [str(len(load_tokenizer(llama_dir).encode("hello world"))), "False", "False"]
