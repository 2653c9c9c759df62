"""The kernel bench's graph-width row: decode attention as a captured CUDA graph launches it.

A graph's block table is as wide as ``max_model_len`` (32k tokens here) whatever the rows'
real contexts, so the launch's split count comes from that width alone. Batch 64 with
contexts spread over 1k-8k, timed side by side in one run: the plan the kernels use now
(each row cuts its own context into splits on the device) and the plan sized for the width
alone (every row one slice of ~6.5k tokens: one split at these lengths), with the achieved
K/V bandwidth against the copy bandwidth. Owns only the measurement; the kernels are imported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bench.gpu.kernels import DecodeShape

GRAPH_BATCH = 64
GRAPH_CONTEXTS = (1024, 8192)  # the rows' contexts, evenly spread over this range
GRAPH_WIDTH_TOKENS = 32768  # the table's width: max_model_len


def graph_width_row(
    copy_bw: float,
    shape: DecodeShape,
    timer: Callable[[Callable[[], object]], float] | None = None,
    batch: int = GRAPH_BATCH,
    contexts: tuple[int, int] = GRAPH_CONTEXTS,
    width_tokens: int = GRAPH_WIDTH_TOKENS,
) -> dict[str, object]:
    """Time both plans on one wide-table batch; a dict for the report (``error`` if it raised)."""
    from inflight.kernels.triton_common import num_sms
    from inflight.kernels.triton_decode_attention import decode_with_plan, plan_decode, row_splits

    if timer is None:
        from bench.gpu.timing import median_ms as timer
    lo, hi = contexts
    lens_list = [lo + (hi - lo) * i // max(batch - 1, 1) for i in range(batch)]
    dev, bs = shape.device, shape.block_size
    width = -(-width_tokens // bs)
    needed = [-(-n // bs) for n in lens_list]
    num_blocks = sum(needed)
    cache_shape = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.empty(cache_shape, dtype=shape.dtype, device=dev).normal_()
    v_cache = torch.empty(cache_shape, dtype=shape.dtype, device=dev).normal_()
    order = torch.randperm(num_blocks, device=dev).int()
    tables = torch.randint(0, num_blocks, (batch, width), dtype=torch.int32, device=dev)
    used = 0
    for s, n in enumerate(needed):
        tables[s, :n] = order[used : used + n]
        used += n
    lens = torch.tensor(lens_list, dtype=torch.int32, device=dev)
    query = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=dev)
    args = (query, k_cache, v_cache, tables, lens, shape.head_dim**-0.5)
    per_row = plan_decode(batch, shape.num_kv_heads, width * bs, shape.head_dim, num_sms(query.device))
    by_width = dataclasses.replace(per_row, min_split_tokens=0)
    elem = torch.finfo(shape.dtype).bits // 8
    nbytes = 2 * sum(lens_list) * shape.num_kv_heads * shape.head_dim * elem
    row: dict[str, object] = {"batch": batch, "contexts": f"{lo}-{hi}", "width_tokens": width * bs,
                              "max_splits": per_row.num_splits,
                              "splits_per_row": f"{row_splits(lo, per_row)[0]}-{row_splits(hi, per_row)[0]}",
                              "splits_by_width": f"{row_splits(lo, by_width)[0]}-{row_splits(hi, by_width)[0]}"}  # fmt: skip
    for name, plan in (("per_row", per_row), ("by_width", by_width)):
        ms = timer(lambda plan=plan: decode_with_plan(*args, plan))
        row[f"{name}_ms"] = ms
        row[f"{name}_fraction_of_copy"] = nbytes / (ms * 1e-3) / copy_bw
    row["speedup"] = row["by_width_ms"] / row["per_row_ms"]  # type: ignore[operator]
    print(f"\nGraph-width decode (batch {batch}, contexts {lo}-{hi}, table {width * bs} tokens): "
          f"per-row splits {row['splits_per_row']} {row['per_row_ms'] * 1e3:.1f} us "  # type: ignore[operator]
          f"({100 * row['per_row_fraction_of_copy']:.0f}% of copy) vs width-sized "  # type: ignore[operator]
          f"{row['splits_by_width']} {row['by_width_ms'] * 1e3:.1f} us "  # type: ignore[operator]
          f"({100 * row['by_width_fraction_of_copy']:.0f}%): {row['speedup']:.2f}x")  # type: ignore[operator]
    return row


def safe_graph_width_row(copy_bw: float, shape: DecodeShape, **kwargs: object) -> dict[str, object]:
    """:func:`graph_width_row`, its failure a row with the error (the other tables stand)."""
    try:
        return graph_width_row(copy_bw, shape, **kwargs)  # type: ignore[arg-type]
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
        print(f"\nGraph-width decode FAILED: {error}")
        return {"error": error}
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
