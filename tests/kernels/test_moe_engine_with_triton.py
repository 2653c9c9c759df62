"""A mixture-of-experts engine on the Triton kernels (fused MoE included; the interpreter on the
CPU) generates what it does on the torch references: chunked prompts, a shared prefix, ragged
decodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .test_engine_with_triton import _generate

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny seeded Qwen3-MoE demo model: a dense layer, then an expert layer (8 experts, top-2)."""
    from inflight.runtime.demo.model import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("qwen3-moe-tiny"), arch="qwen3_moe", size="tiny", seed=1)


def test_moe_engine_greedy_tokens_match_torch_backend(tiny_moe_dir: Path, device: torch.device) -> None:
    assert _generate(tiny_moe_dir, "triton", device) == _generate(tiny_moe_dir, "torch", device)
