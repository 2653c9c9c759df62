"""The kernel benchmark's CPU-checkable parts: the no-GPU exit, the roofline arithmetic and
the engine timing loop (run on the CPU engine with the torch kernels)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.gpu import engine as bench_engine
from bench.gpu import kernels as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_without_cuda_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_kv_bytes_counts_k_and_v() -> None:
    shape = bench.DecodeShape(num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert bench.kv_bytes(2, 1024, shape) == 2 * 2 * 1024 * 8 * 128 * 2


def test_model_bytes_match_the_checkpoint(tiny_model_dir: Path) -> None:
    from safetensors.torch import load_file

    sizes = bench_engine.model_bytes(tiny_model_dir, torch.bfloat16)
    tensors = {}
    for path in tiny_model_dir.glob("*.safetensors"):
        tensors.update(load_file(str(path)))
    untied = any(name.endswith("lm_head.weight") for name in tensors)
    streamed = sum(
        t.numel() for n, t in tensors.items() if not (untied and n.endswith("embed_tokens.weight"))
    )
    assert sizes.weight_bytes == 2 * streamed
    assert sizes.kv_bytes_per_token > 0


def test_time_decode_steps_on_cpu_engine(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inflight.runtime.config import EngineConfig
    from inflight.runtime.core.engine import LLMEngine

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench_engine, "TIMED_STEPS", 4)
    config = EngineConfig(
        device="cpu", kernel_backend="torch", num_kv_blocks=64, max_num_sequences=4
    )
    engine = LLMEngine.from_model_dir(tiny_model_dir, config)
    seconds, mean_context = bench_engine.time_decode_steps(engine, 3, 100)
    assert seconds > 0
    assert bench_engine.PROMPT_LEN < mean_context < bench_engine.PROMPT_LEN + 20
    assert not engine.has_unfinished_requests()


def test_print_targets_reads_the_issue_thresholds(capsys: pytest.CaptureFixture[str]) -> None:
    decode = [
        {"batch": 1, "context": 32768, "fraction_of_copy": 0.2},  # outside the target range
        {"batch": 64, "context": 2048, "fraction_of_copy": 0.75},
        {"batch": 64, "context": 8192, "fraction_of_copy": 0.9},
        {"batch": 64, "context": 32768, "fraction_of_copy": 0.5},  # outside too
    ]
    bench.print_targets(decode, [{"batch": 64, "x_roofline": 2.5}, {"batch": 1, "x_roofline": 1.9}])
    out = capsys.readouterr().out
    assert "worst 75% -> met" in out
    assert "<= 1.5x roofline at batch 64: 2.50x -> NOT met" in out
    assert "<= 2.0x roofline at batch 1: 1.90x -> met" in out


def test_decode_table_on_the_interpreter(device: torch.device, capsys) -> None:
    """The table's plumbing (shuffled caches, bytes / time, memory cap) with a fake timer."""
    shape = bench.DecodeShape(num_heads=4, num_kv_heads=2, head_dim=64, device=device.type)
    calls: list[float] = []

    def timer(fn) -> float:
        out = fn()
        calls.append(float(out.float().abs().sum()))
        return 0.5  # ms

    cap = bench.kv_bytes(2, 40, shape)
    rows = bench.decode_table(100e9, (1, 2), (16, 40), cap, shape=shape, timer=timer)
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 16), (1, 40), (2, 16), (2, 40)]
    assert all(c > 0 for c in calls)  # the kernel ran and wrote finite output
    row = rows[-1]
    assert row["gb_per_s"] == pytest.approx(cap / 0.5e-3 / 1e9)
    assert row["fraction_of_copy"] == pytest.approx(row["gb_per_s"] / 100)
    rows = bench.decode_table(100e9, (2,), (40,), cap - 1, shape=shape, timer=timer)
    assert rows == [] and "skipped" in capsys.readouterr().out
