"""The EAGLE-3 head's fast path: a pass of decode rows only (every chained draft, a decode step's
catch-up) runs its attention block as one kernel call (``ops.decode_attention_block``), and gives
bit for bit what the per-op path it replaces gives: the same states, the same KV entries, the same
drafts, the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import inflight.runtime.spec_decode.eagle3_head as eagle3_head
from inflight.runtime.demo.model import make_demo_model
from inflight.runtime.worker.batch_inputs import Segment, pack_segments
from tests.runtime.test_speculative import _engine, _requests, _run
from tests.runtime.test_speculative_eagle3 import eagle3_spec, make_head


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle3-paths")
    target = make_demo_model(root / "target", "llama", config_overrides={"num_hidden_layers": 4})
    return target, make_head(target, root / "head")


def test_a_decode_pass_takes_the_one_call_block_and_matches_the_per_op_path(models, monkeypatch) -> None:
    engine = _engine(models[0], eagle3_spec(models[1]), enable_prefix_caching=False)
    try:
        drafter, ops = engine.drafter, engine.runner.ops
        assert ops.decode_attention_block is not None  # the CPU bundle has the one-call block
        gen = torch.Generator().manual_seed(3)
        hidden_size = drafter.head.spec.hidden_size
        prompt = pack_segments([Segment(list(range(5, 45)), 0, [1, 2, 3], False)], drafter.block_size,
                               engine.runner.device)  # fmt: skip
        with torch.inference_mode():  # the head's KV at positions 0..39
            drafter.head(drafter.target.model.embed(prompt.input_ids), torch.randn(40, hidden_size, generator=gen),
                         prompt.positions, drafter.cos_sin, drafter.kv_caches[0], prompt.meta, ops)  # fmt: skip
        # a catch-up of two rows and a chained row, at positions 38..40
        packed = pack_segments([Segment((9, 11), 38, [1, 2, 3], True, 2), Segment((7,), 40, [1, 2, 3], True, 1)],
                               drafter.block_size, engine.runner.device)  # fmt: skip
        state = torch.randn(3, hidden_size, generator=gen)
        taken: list[bool] = []
        real = eagle3_head.decode_rows
        results = {}
        for path in ("one call", "per op"):
            cache = tuple(t.clone() for t in drafter.kv_caches[0])
            with monkeypatch.context() as m:
                m.setattr(eagle3_head, "decode_rows",
                          (lambda *a: taken.append(True) or real(*a)) if path == "one call" else (lambda *a: None))
                with torch.inference_mode():
                    out = drafter.head(drafter.target.model.embed(packed.input_ids), state, packed.positions,
                                       drafter.cos_sin, cache, packed.meta, ops)  # fmt: skip
            results[path] = (*out, *cache)
        assert taken and real(packed.positions, packed.meta, ops) is not None  # the block was handed its rows
        for got, want in zip(results["one call"], results["per op"], strict=True):
            assert torch.equal(got, want)
        assert not torch.equal(results["one call"][2], drafter.kv_caches[0][0])  # the pass wrote its entries
    finally:
        engine.close()


def test_the_engine_drafts_and_emits_the_same_with_either_path(models, monkeypatch) -> None:
    requests = _requests(1024)[:4]
    runs = {}
    for path in ("one call", "per op"):
        with monkeypatch.context() as m:
            if path == "per op":
                m.setattr(eagle3_head, "decode_rows", lambda *args: None)
            engine = _engine(models[0], eagle3_spec(models[1]), enable_prefix_caching=False)
            runs[path] = (_run(engine, requests), engine.stats().spec_num_drafts,
                          list(engine.stats().spec_accepted_per_position))  # fmt: skip
    assert runs["one call"][1] > 0
    assert runs["one call"] == runs["per op"]
    assert runs["one call"][0] == _run(_engine(models[0], None, enable_prefix_caching=False), requests)
