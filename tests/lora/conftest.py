"""Fixtures of the LoRA tests: a seeded demo model per family and four PEFT adapters of each
(ranks 8, 4, 16 and 2; all seven modules, attention only, rsLoRA, and a regex target), made once
per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.runtime.demo.model import make_demo_model
from tests.lora.peft_helpers import make_adapter

# (rank, alpha, target_modules, use_rslora) of the four adapters every family gets
ADAPTERS = (
    (8, 16.0, None, False),
    (4, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    (16, 8.0, ["q_proj", "v_proj", "up_proj", "down_proj"], True),
    (2, 4.0, r".*\.(k_proj|o_proj|gate_proj)", False),
)


@pytest.fixture(scope="session")
def lora_models(tmp_path_factory: pytest.TempPathFactory):
    """``make(arch) -> (model_dir, [adapter_dir] * 4)``."""
    made: dict[str, tuple[Path, list[Path]]] = {}

    def make(arch: str = "llama") -> tuple[Path, list[Path]]:
        if arch not in made:
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            model = make_demo_model(root / "model", arch, "tiny", 0)
            adapters = [make_adapter(model, root / f"adapter{i}", seed=100 + i, r=r, alpha=alpha, targets=targets,
                                     use_rslora=rs)
                        for i, (r, alpha, targets, rs) in enumerate(ADAPTERS)]  # fmt: skip
            made[arch] = (model, adapters)
        return made[arch]

    return make
