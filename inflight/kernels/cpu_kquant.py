"""Native CPU kernels for GGUF K-quant weights (Q4_K, Q5_K, Q6_K): builds ``cpu_kquant.c``.

The library is compiled like :mod:`inflight.kernels.cpu_native`'s (same compiler, flags and
cache folder, keyed by this source) and exports the two entry points of ``cpu_quant.c`` under
``inflight_kquant_*`` names with the same signatures. :mod:`inflight.kernels.cpu_quant` picks
this library for the K-quant types and holds the Python wrappers; this module only builds and
binds it. Knows nothing about models or GGUF files.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

from inflight.kernels import cpu_native

SOURCE = Path(__file__).with_name("cpu_kquant.c")
_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "inflight_kquant_dequantize_f32": (None, [_ptr, _int, _ptr, _i64, _i64, _int]),
    "inflight_kquant_linear_f32": (ctypes.c_int, [_ptr, _ptr, _int, _ptr, _ptr, _i64, _i64, _i64, _int]),
}


@lru_cache(maxsize=1)
def load_library() -> tuple[ctypes.CDLL | None, str]:
    """The loaded K-quant kernels and where they came from, or ``(None, why not)``."""
    return cpu_native.compile_library(SOURCE, "cpu_kquant", _SIGNATURES)
