"""How a prepacked float32 weight's bytes are laid out beyond the packed buffer itself: column
panels for the panel kernel, and column blocks for MKL's packed GEMM.

The packed formats and the choice between them are :mod:`.cpu_packed`'s; this module only cuts
and reshapes a weight (and writes the table C reads MKL's blocks from). Knows nothing about the
model.

Panels: the row-major few-row kernel reads a weight row per output column and reduces it across
the vector lanes; it ran bench-medium's linears at 31 GFLOP/s on two threads at 16 rows, and
behind oneDNN from 16 rows up. So the float copy of an unshared weight is kept in column panels
instead (:func:`to_panels`: ``[ceil(out / 16), in, 16]``), which the panel kernel
(``cpu_panel_linear.h``) multiplies as an outer-product register tile of up to 6 rows (12
where AVX-512 is there) x 16 columns, no horizontal reduction. bench-medium's 72 linears on the AMD EPYC, ms, few-row kernel
/ panel kernel / oneDNN packed, two threads: 1 row 14.5 / 11.7 / 22.6, 4 rows 16.1 / 15.4 /
25.3, 16 rows 39.0 / 26.2 / 35.3, 32 rows 68.7 / 39.5 / 51.0, 64 rows 134 / 70.1 / 74.6 (one
thread, 64 rows: 245 / 140 / 146); an 8B-sized layer (4096 wide, 14336 intermediate) the same
way, even with oneDNN at 128 rows. Products of at most ``cpu_packed.PANEL_MAX_ROWS`` rows take it,
which also lets the one-call decode stack take every decode step of up to that many rows over
oneDNN weights. A shared weight (the tied head) keeps the row-major table as its copy rather than
a second one in panels, and its products of at most ``cpu_packed.FLOAT_COPY_MAX_ROWS`` rows take the
few-row kernel.

Column blocks: MKL's packed weights are packed in up to one column block per thread a big step
uses (:func:`column_starts`: whole 16-column groups, none under :data:`MIN_BLOCK_COLS` columns),
each block its own ``cblas_sgemm_pack``. A product spreads the blocks over an OpenMP team, and
MKL runs inside it on one thread per block (cpu_decode_stack.h's ``inflight_packed_gemm_f32``):
one fork and join a product, each thread streaming its own columns of the weight once. MKL's own
threading of one whole packed weight kept ~1.4 of 2 cores busy on few-row products under the
passive OpenMP waits the server needs (its threads meet more than once a product, and every
meeting wakes a sleeping thread). bench-medium's linears on a 2-core Xeon (AVX-512), ms, whole /
two blocks: 1 row 8.4 / 7.1, 4 rows 9.8 / 7.7, 16 rows 16.3 / 12.2, 48 rows 33.7 / 23.4, 256
rows 194 / 154; at 512-2048 rows within the noise of each other. A product of 512 rows or more
(a prompt step) is handed out instead as 256-row chunks of each block, one at a time, so a
thread the OS lends to the server's front end for a while leaves its share to the other: with
one item per thread the served medium burst's p99 TTFT was ~13% longer than on the whole weight
(medians 6.6 against 5.8 s, five alternations each), with the chunks 5.7-6.4 against 5.8-6.7 s.
The bits are the same as the whole weight's (each output column is one block's, summed over the
same inputs in the same order; the tests check it). With the products split this way, a whole
pure-decode step beat two decode lanes at every row count (``device_setup.cpu_lanes``), so such
a model runs without lanes. oneDNN's format stays whole.
"""

from __future__ import annotations

import torch

# Output columns per panel: two 8-float vectors (cpu_panel_linear.h's PANEL_COLS).
PANEL_COLS = 16
# The narrowest column block MKL's packed weights are split into (see "Column blocks").
MIN_BLOCK_COLS = 64


def column_starts(out_features: int, num_blocks: int) -> tuple[int, ...]:
    """The first output column of each of at most ``num_blocks`` column blocks of a weight:
    whole :data:`PANEL_COLS`-column groups, as even as they come, none under
    :data:`MIN_BLOCK_COLS` columns (so a narrow weight gets fewer blocks, at least one)."""
    groups = -(-out_features // PANEL_COLS)
    count = max(1, min(num_blocks, out_features // MIN_BLOCK_COLS, groups))
    return tuple(PANEL_COLS * (groups * b // count) for b in range(count))


def mkl_table(blocks: tuple[torch.Tensor, ...], starts: tuple[int, ...]) -> torch.Tensor:
    """The int64 table C reads MKL-packed blocks from: count, addresses, first columns."""
    addresses = [int(torch.ops.mkldnn.data_ptr(block)) for block in blocks]
    return torch.tensor([len(blocks), *addresses, *starts], dtype=torch.int64)


def to_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[out_features, in_features]`` -> ``[ceil(out / PANEL_COLS), in_features, PANEL_COLS]``:
    panel ``p`` holds output columns ``PANEL_COLS * p`` onwards, one row of them per input
    feature, zeros past ``out_features`` (the layout of cpu_panel_linear.h)."""
    out_features, in_features = weight.shape
    padded = -(-out_features // PANEL_COLS) * PANEL_COLS
    w = torch.zeros(padded, in_features, dtype=weight.dtype)
    w[:out_features] = weight
    return w.view(padded // PANEL_COLS, PANEL_COLS, in_features).transpose(1, 2).contiguous()


def from_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The row-major ``[out_features, in_features]`` weight :func:`to_panels` made ``panels`` from."""
    num_panels, in_features, cols = panels.shape
    return panels.transpose(1, 2).reshape(num_panels * cols, in_features)[:out_features].contiguous()
