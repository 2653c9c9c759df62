"""The CPU thread policy: every core for big steps only when OpenMP waits passively."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from inflight.runtime.worker.cpu import device_setup


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    for name in ("INFLIGHT_CPU_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_passive_waits_use_every_core_for_big_steps(four_cores: pytest.MonkeyPatch) -> None:
    four_cores.setenv("OMP_WAIT_POLICY", "passive")
    assert device_setup.cpu_thread_counts() == (3, 4)
    assert device_setup.cpu_threads() == 3


def test_spinning_waits_keep_a_core_free(four_cores: pytest.MonkeyPatch) -> None:
    assert device_setup.cpu_thread_counts() == (3, 3)
    four_cores.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert device_setup.cpu_thread_counts() == (3, 3)


def test_explicit_thread_count_wins(four_cores: pytest.MonkeyPatch) -> None:
    four_cores.setenv("OMP_WAIT_POLICY", "PASSIVE")
    four_cores.setenv("INFLIGHT_CPU_THREADS", "2")
    assert device_setup.cpu_thread_counts() == (2, 2)


def test_lanes_are_one_per_thread_unless_the_products_are_split_or_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFLIGHT_CPU_LANES", raising=False)
    assert device_setup.cpu_lanes(2) == 2
    assert device_setup.cpu_lanes(2, products_split=True) == 0
    monkeypatch.setenv("INFLIGHT_CPU_LANES", "3")
    assert device_setup.cpu_lanes(2, products_split=True) == 3
    monkeypatch.setenv("INFLIGHT_CPU_LANES", "0")
    assert device_setup.cpu_lanes(2) == 0


def test_runtime_import_sets_passive_waits_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import inflight.runtime, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "PASSIVE"
    code = "import torch, inflight.runtime, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "None"  # torch (libgomp) already loaded: its policy is left alone


def test_a_step_is_big_by_its_size_when_nothing_streams() -> None:
    small_step = device_setup.BIG_STEP_PARAM_TOKENS - 1
    assert not device_setup.big_step(1, small_step)
    assert device_setup.big_step(1, device_setup.BIG_STEP_PARAM_TOKENS)
    assert device_setup.big_step(64, 1_000_000, num_streamed=None)  # a pooling pass of a tiny model


def test_a_tiny_models_decode_leaves_a_core_to_the_host_until_its_attention_makes_it_work() -> None:
    params, kv_bytes = 1_000_000, 2048  # the host model: 2 FLOPs a weight, 2 KiB of cache a context token
    rows = 256
    short = torch.full((rows,), 100, dtype=torch.int32)
    assert not device_setup.big_step(rows, params, rows, short, kv_bytes)
    # each row reads enough cache that its forward outweighs the host's work for its token
    per_row_context = (device_setup.ROW_FLOPS_FOR_EVERY_CORE - 2 * params) / (device_setup.FLOPS_PER_KV_BYTE * kv_bytes)
    long = torch.full((rows,), int(per_row_context) + 1, dtype=torch.int32)
    assert device_setup.big_step(rows, params, rows, long, kv_bytes)
    assert not device_setup.big_step(rows, params, rows, long - 2, kv_bytes)


def test_a_bigger_models_rows_or_a_prompt_chunk_use_every_core() -> None:
    assert device_setup.big_step(256, 7_000_000, 256, torch.full((256,), 1, dtype=torch.int32), 8192)
    assert device_setup.big_step(8, 135_000_000, 8)  # SmolLM2's few decodes
    # a 512-token prompt chunk of the tiny model samples one row: the chunk's work is all its own
    assert device_setup.big_step(512, 1_000_000, 1, torch.zeros(0, dtype=torch.int32), 2048)
    assert not device_setup.big_step(512, 1_000_000, 512, torch.zeros(0, dtype=torch.int32), 2048)
