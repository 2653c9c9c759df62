"""The CPU thread policy: every core for big steps only when OpenMP waits passively."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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
