"""Every Triton kernel lowers to a cubin for Ampere and Hopper, with no GPU present.

Runs ``python -m bench.gpu.compile_check`` in a child process because the kernels in
this process are the interpreter's (``TRITON_INTERPRET=1``), not JIT functions.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("arch", "dtype", "head_dim", "block_size"), [(90, "bf16", 128, 16), (80, "fp16", 64, 32)]
)
def test_kernels_compile_for_gpu_targets(
    arch: int, dtype: str, head_dim: int, block_size: int
) -> None:
    triton = pytest.importorskip("triton")
    backends = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(backends):
        pytest.skip("this triton build has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu.compile_check",
        "--arch",
        str(arch),
        "--dtype",
        dtype,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    names = {line.split()[0] for line in lines}
    expected = {"store_kv", "decode_split", "decode_direct", "decode_reduce", "decode_per_row", "decode_reduce_row", "prefill", "rms_norm",
                "rotary", "silu_and_mul", "quant_q4_0", "quant_q4_1", "quant_q8_0", "quant_q4_k",
                "quant_q5_k", "quant_q6_k", "quant_reduce", "intq_int4_g128", "intq_int4_g32_zp",
                "intq_int8_channel", "intq_int4_g8_zp", "lora_shrink", "lora_expand",
                "store_kv_fp8", "decode_fp8", "prefill_fp8",  # fp8 KV caches: bytes, bit-decoded
                "mla_decode", "mla_decode_split", "mla_merge", "mla_prefill",  # DeepSeek's absorbed latent attention
                "gated_delta_conv", "gated_delta_chunk",  # Qwen3-Next's linear attention
                "mamba2_conv", "mamba2_chunk"}  # fmt: skip (Granite 4's Mamba-2 layers)
    assert names == expected and all(" ok " in line for line in lines), proc.stdout
    # Decode attention reads K/V with 16-byte asynchronous copies (no scalar 2-byte loads).
    decode = next(line for line in lines if line.startswith("decode_split"))
    assert "16b:" not in decode
