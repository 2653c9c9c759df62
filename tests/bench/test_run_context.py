"""The bench's run conditions (inflight.bench.run_context): /proc/stat steal accounting, a
server's process layout read from /proc, and the oneDNN verbose-log check for float32."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.bench import run_context

F32_MATMUL = ("onednn_verbose,v1,primitive,create:cache_miss,cpu,matmul,brg_matmul:avx512_core,undef,"
              "src:f32::blocked:ab::f0 wei:f32::blocked:BA16a64b::f0 dst:f32::blocked:ab::f0,attr-scratchpad:user,,"
              "9x256:256x512,0.29")
REORDER = ("onednn_verbose,v1,primitive,create:cache_miss,cpu,reorder,jit:uni,undef,src:f32::blocked:ba::f0 "
           "dst:f32::blocked:BA16a64b::f0,,,256x512,0.12")


def test_steal_fraction_from_two_stat_samples(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 0 40 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    before = run_context.cpu_times(stat)
    assert before == run_context.CpuTimes(1000, 40)  # guest (7) is inside user already: not counted twice
    stat.write_text("cpu  200 0 100 1500 10 0 0 190 0 0\n")
    after = run_context.cpu_times(stat)
    assert after is not None and run_context.steal_fraction(before, after) == pytest.approx(150 / 1000)
    assert math.isnan(run_context.steal_fraction(after, after))  # no time passed
    assert math.isnan(run_context.steal_fraction(None, after))
    stat.write_text("cpu  1 2 3\n")  # no steal column
    assert run_context.cpu_times(stat) is None
    assert run_context.cpu_times(tmp_path / "missing") is None


def test_the_machines_own_stat_reads() -> None:
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc/stat here")
    a = run_context.cpu_times()
    sum(i * i for i in range(200_000))
    b = run_context.cpu_times()
    assert a is not None and b is not None and b.total >= a.total and b.steal >= a.steal


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or not Path("/proc/self/task").exists(),
                    reason="needs Linux /proc and CPU affinity")
def test_server_layout_counts_processes_threads_and_their_cpus() -> None:
    cpu = sorted(os.sched_getaffinity(0))[0]
    # A parent with a second thread and a child pinned to one CPU.
    code = (f"import os, subprocess, sys, threading, time\n"
            f"child = subprocess.Popen([sys.executable, '-c', 'import os, time; os.sched_setaffinity(0, {{{cpu}}}); "
            f"print(1, flush=True); time.sleep(60)'], stdout=subprocess.PIPE)\n"
            f"child.stdout.readline()\n"
            f"threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            f"print('ready', flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline().strip() == "ready"
        layout = run_context.server_layout(parent.pid)
    finally:
        os.killpg(parent.pid, 9)
        parent.wait(10)
    assert layout is not None and len(layout.processes) == 2
    assert layout.threads == 3  # the parent's two, the child's one
    placement = dict(layout.placement)
    assert placement[str(cpu)] >= 1 and sum(placement.values()) == 3
    procs, threads = run_context.describe_layout(layout)
    assert procs.startswith("2 (") and threads.startswith("3 (") and f"CPUs {cpu}: " in threads
    assert run_context.server_layout(parent.pid) is None  # gone
    assert run_context.describe_layout(None) == ("n/a", "n/a")


def test_onednn_check_reads_types_implementations_and_fpmath() -> None:
    check = run_context.onednn_check("\n".join(["noise", REORDER, F32_MATMUL, F32_MATMUL.replace("9x256", "1x256")]))
    assert check.primitives == 2 and check.dtypes == ("f32",) and check.implementations == ("brg_matmul:avx512_core",)
    assert check.float32 and "2 compute primitives created" in check.describe() and check.describe().endswith(": fp32")
    # A float32 product oneDNN may compute in bf16: the fpmath attribute says so.
    quiet_bf16 = F32_MATMUL.replace("attr-scratchpad:user", "attr-scratchpad:user attr-fpmath:bf16")
    check = run_context.onednn_check("\n".join([F32_MATMUL, quiet_bf16]))
    assert check.fpmath == ("bf16",) and not check.float32 and "**NOT fp32**" in check.describe()
    # bf16 data outright.
    bf16 = F32_MATMUL.replace("src:f32", "src:bf16").replace("wei:f32", "wei:bf16")
    check = run_context.onednn_check(bf16)
    assert check.dtypes == ("bf16", "f32") and not check.float32
    # A bias the primitive was created without reads "undef": not a data type.
    no_bias = F32_MATMUL.replace("dst:f32::blocked:ab::f0", "bia:undef::undef::f0 dst:f32::blocked:ab::f0")
    assert run_context.onednn_check(no_bias).float32
    # Nothing created: nothing to check, and not called fp32.
    empty = run_context.onednn_check(REORDER)
    assert empty.primitives == 0 and not empty.float32 and "no oneDNN compute primitive" in empty.describe()


def test_per_rep_cells() -> None:
    assert run_context.per_rep([0.5, float("nan"), 1.25], "{:.2f}") == "0.50 / n/a / 1.25"
    assert run_context.per_rep([], "{:.1f}") == "n/a"
