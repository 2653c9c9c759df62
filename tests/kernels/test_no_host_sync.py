"""On CUDA the kernel wrappers launch without a device-to-host sync (so a decode step can be
captured in a CUDA graph and never stalls the CPU): every choice comes from shapes."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_wrappers_do_not_sync(make_paged_cache) -> None:
    from inflight.kernels.triton_ops import TRITON_OPS as ops

    dev = torch.device("cuda")
    paged = make_paged_cache([700, 33, 1], 16, 2, 64, torch.bfloat16, dev)
    q = torch.randn(3, 8, 64, device=dev, dtype=torch.bfloat16)
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device=dev)
    slots = torch.arange(3, device=dev)
    x = torch.randn(3, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(512, device=dev, dtype=torch.bfloat16)
    cos_sin = torch.randn(800, 64, device=dev)
    positions = torch.tensor([699, 32, 0], device=dev)
    args = (paged.k_cache, paged.v_cache, paged.block_tables)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.store_kv_cache(q[:, :2], q[:, 2:4], paged.k_cache, paged.v_cache, slots)
        ops.paged_decode_attention(q, *args, paged.context_lens, 0.125)
        ops.paged_prefill_attention(q, *args, starts, paged.context_lens, 0.125)
        ops.rms_norm(x, w, 1e-6, x)
        ops.rotary_embedding(positions, q, q[:, :2], cos_sin)
        ops.silu_and_mul(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
