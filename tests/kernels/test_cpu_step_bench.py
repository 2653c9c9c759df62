"""The CPU step benchmark's parts (inflight/bench/cpu_step.py): variant names, the decode attention
built from another C file, and one profiled run on a tiny engine. Nothing here times anything."""

from __future__ import annotations

import shutil

import pytest
import torch

from inflight.bench import cpu_step
from inflight.kernels import cpu_native


def test_variants_parse_and_unknown_modifiers_are_refused() -> None:
    assert cpu_step.parse_variant("default") == frozenset()
    assert cpu_step.parse_variant("one-thread+unpacked+alt-attn") == {"one-thread", "unpacked", "alt-attn"}
    with pytest.raises(ValueError, match="unknown variant modifier"):
        cpu_step.parse_variant("unpacked+fast")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_attention_from_another_source_file_is_the_same_kernel(make_paged_cache) -> None:
    attention = cpu_step.alt_attention(cpu_native.SOURCE)  # the current source, built a second time
    paged = make_paged_cache([5, 40], 16, 2, 64, torch.float32, torch.device("cpu"))
    query = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(0))
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1))
    args = (query, paged.k_cache, paged.v_cache, paged.block_tables, paged.context_lens, 0.125, 17, sinks)
    assert torch.equal(attention(*args), cpu_native.paged_decode_attention(*args))


def test_a_profiled_run_splits_the_step_by_kernel(tiny_model_dir) -> None:
    engine = cpu_step.load_engine(tiny_model_dir, frozenset({"no-lanes"}), batch=4, max_len=64, alt=None)
    timer = cpu_step.OpTimer(engine)
    prompts = [[5 + i, 9, 11, 13] for i in range(4)]
    result = cpu_step.time_decode(engine, prompts, steps=2, tag="t", timer=timer)
    timer.close()
    ops = result["ops_ms"]
    assert result["step_ms"] > 0 and {"linear.qkv_proj", "linear.down_proj", "paged_decode_attention"} <= set(ops)
    assert abs(sum(ops.values()) - result["step_ms"]) < 1e-6  # "rest" closes the sum
    assert engine.runner.ops is timer._original and not engine.has_unfinished_requests()
    assert "| linear.qkv_proj |" in "\n".join(cpu_step.profile_table({"v": {**ops, "step": result["step_ms"]}}))
