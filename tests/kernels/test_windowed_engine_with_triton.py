"""A sliding-window model on the Triton kernels (the interpreter on the CPU) generates what it
does on the torch references: Gemma 3's local layers (a 16-token window, prompts of up to 40
tokens, chunked) and global layers in one model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .test_engine_with_triton import _generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("gemma3-tiny"), arch="gemma3", size="tiny", seed=1)


def test_windowed_engine_greedy_tokens_match_torch_backend(tiny_gemma3_dir: Path, device: torch.device) -> None:
    assert _generate(tiny_gemma3_dir, "triton", device) == _generate(tiny_gemma3_dir, "torch", device)
