"""Smoke test of ``bench/train_eagle3.py`` in its tiny mode (a random 4-layer demo model): every
stage runs, the head it saves loads through the served EAGLE-3 loader with its reduced draft
vocabulary, and the side-by-side measurement reports both systems; and the training head's
math is the served head's (a head trained on the very prompts it is measured on drafts tokens the
target keeps, which a mismatch in layout, rope, masks or shifts would not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.train_eagle3 import main
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config
from inflight.runtime.spec_decode.eagle3_head import load_head, read_head_config


def test_tiny_run_saves_a_loadable_head_and_measures_both(tmp_path: Path) -> None:
    head_dir = tmp_path / "head"
    assert main(["--tiny", "--out", str(head_dir), "--epochs", "1", "--gen-tokens", "8", "--reps", "1",
                 "--batch", "2", "--max-tokens", "6", "--draft-vocab", "200"]) == 0  # fmt: skip
    config = json.loads((head_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 200
    target = spec_from_hf_config(load_hf_config(tmp_path / "tiny-target"))
    _, spec, eagle = read_head_config(head_dir, target)
    assert eagle.aux_layer_ids == (0, 2, 3) and eagle.draft_vocab_size == 200
    head = load_head(head_dir, spec, eagle, torch.device("cpu"), torch.float32)
    assert head.draft_to_target.shape == (200,) and not head.identity_vocab
    results = json.loads((head_dir / "bench.json").read_text())["results"]
    assert set(results) == {"none", "eagle3 k=3"}
    assert results["none"]["acceptance"] is None and results["eagle3 k=3"]["acceptance"] is not None
    assert len(results["eagle3 k=3"]["acceptance_per_position"]) == 3


def test_a_head_fitted_to_its_prompts_drafts_what_the_target_keeps(tmp_path: Path) -> None:
    head_dir = tmp_path / "head"
    assert main(["--tiny", "--eval-on-train", "--out", str(head_dir), "--epochs", "40", "--gen-tokens", "24",
                 "--reps", "1", "--batch", "2", "--max-tokens", "16", "--draft-vocab", "1024"]) == 0  # fmt: skip
    results = json.loads((head_dir / "bench.json").read_text())["results"]
    assert results["eagle3 k=3"]["acceptance"] > 0.3, results  # measured 0.47; a layout or math mismatch drafts ~0
