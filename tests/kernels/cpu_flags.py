"""Whether this CPU lists a feature flag, for tests that build a kernel without it (the 8-wide
builds an AVX2 machine runs) and skip where the default build already is that one."""

from __future__ import annotations

from inflight.kernels.cpu_prepack import cpuinfo_line


def has_cpu_flag(flag: str) -> bool:
    """``flag`` (e.g. ``avx512f``) is one of the words of /proc/cpuinfo's first ``flags`` line."""
    line = cpuinfo_line("flags")
    return line is not None and flag in line.partition(":")[2].split()
