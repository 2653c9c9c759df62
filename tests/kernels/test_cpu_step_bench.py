"""The CPU step benchmark's parts (bench/cpu/step.py): variant names, the decode attention
built from another C file, and one profiled run on a tiny engine. Nothing here times anything."""

from __future__ import annotations

import shutil

import pytest
import torch

from bench.cpu import step as cpu_step
from inflight.kernels import cpu_native


def test_variants_parse_and_unknown_modifiers_are_refused() -> None:
    assert cpu_step.parse_variant("default") == frozenset()
    assert cpu_step.parse_variant("one-thread+unpacked+alt-attn") == {"one-thread", "unpacked", "alt-attn"}
    assert cpu_step.parse_variant("split-attn") == {"split-attn"}
    assert cpu_step.parse_variant("per-layer") == {"per-layer"}
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
    engine = cpu_step.load_engine(tiny_model_dir, frozenset({"no-lanes", "per-layer"}), batch=4, max_len=64, alt=None)
    timer = cpu_step.OpTimer(engine)
    prompts = [[5 + i, 9, 11, 13] for i in range(4)]
    result = cpu_step.time_decode(engine, prompts, steps=2, tag="t", timer=timer)
    timer.close()
    ops = result["ops_ms"]
    assert result["step_ms"] > 0 and {"linear.qkv_proj", "linear.down_proj", "decode_attention_block"} <= set(ops)
    assert abs(sum(ops.values()) - result["step_ms"]) < 1e-6  # "rest" closes the sum
    assert engine.runner.ops is timer._original and not engine.has_unfinished_requests()
    assert "| linear.qkv_proj |" in "\n".join(cpu_step.profile_table({"v": {**ops, "step": result["step_ms"]}}))
    assert cpu_step.lane_alone(engine, prompts, reps=1) is None  # no decode lanes: nothing to replay


def test_split_attn_runs_the_attention_block_op_by_op(tiny_model_dir) -> None:
    engine = cpu_step.load_engine(tiny_model_dir, frozenset({"no-lanes", "split-attn", "per-layer"}), batch=4,
                                  max_len=64, alt=None)
    assert engine.runner.ops.decode_attention_block is None
    timer = cpu_step.OpTimer(engine)
    ops = cpu_step.time_decode(engine, [[5 + i, 9, 11] for i in range(4)], steps=1, tag="s", timer=timer)["ops_ms"]
    timer.close()
    assert {"rotary_embedding", "store_kv_cache", "paged_decode_attention"} <= set(ops)


def test_one_lane_replays_alone_with_its_ops_and_calls_counted(tiny_model_dir, monkeypatch) -> None:
    from inflight.runtime.worker.cpu import device_setup
    from inflight.runtime.worker.cpu import lanes as cpu_lanes

    monkeypatch.setenv("INFLIGHT_CPU_LANES", "2")
    monkeypatch.setattr(cpu_lanes, "MIN_PARAM_TOKENS", 0)  # a tiny model's step is worth lanes here
    monkeypatch.setattr(device_setup, "ROW_FLOPS_FOR_EVERY_CORE", 0)  # and its rows' work too
    # 20 rows: lanes take the step with or without the float copies (whose floor is 17 rows)
    engine = cpu_step.load_engine(tiny_model_dir, frozenset(), batch=20, max_len=64, alt=None)
    try:
        alone = cpu_step.lane_alone(engine, [[5 + i, 9, 11] for i in range(20)], reps=2)
        assert alone is not None and alone["step"] > 0 and "decode_layer_stack" in alone  # the stack: one call
        assert alone["calls"]["python"] > 0 and alone["calls"]["c"] > 0
        assert not engine.has_unfinished_requests() and "forward" not in vars(engine.runner._lanes)
    finally:
        engine.runner.close()


def test_the_default_runs_the_layer_stack_in_one_call(tiny_model_dir) -> None:
    engine = cpu_step.load_engine(tiny_model_dir, frozenset({"no-lanes"}), batch=4, max_len=64, alt=None)
    timer = cpu_step.OpTimer(engine)
    ops = cpu_step.time_decode(engine, [[5 + i, 9, 11] for i in range(4)], steps=1, tag="d", timer=timer)["ops_ms"]
    timer.close()
    assert "decode_layer_stack" in ops and "linear.lm_head" in ops
    assert not {"linear.qkv_proj", "rms_norm", "decode_attention_block"} & set(ops)
