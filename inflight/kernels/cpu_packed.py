"""Float32 linear weights prepacked once, at load, for MKL's or oneDNN's GEMM on the CPU.

Two packed formats (and an opt-in third with bfloat16 products, at the end), both stock torch
ops; which one a model gets is :func:`inflight.kernels.cpu_prepack.pack_format`'s choice (MKL's on
Intel CPUs, oneDNN's elsewhere; ``INFLIGHT_CPU_PACK_FORMAT`` overrides it).

MKL's: the op is stock torch: ``torch.ops.mkl._mkl_reorder_linear_weight`` packs a weight
(``cblas_sgemm_pack``) and ``torch.ops.mkl._mkl_linear`` multiplies by it
(``cblas_sgemm_compute``); Inductor's freezing pass uses the pair for float32 linears on x86.
On Intel CPUs it is chosen over oneDNN's ``torch.ops.mkldnn._reorder_linear_weight`` /
``_linear_pointwise`` (what vLLM's ``create_onednn_mm`` amounts to) because, on the Intel CPU
(AMX, AVX-512) where this was measured, it is faster at every row count the engine runs. All
of a model's linears (distinct weights, as a step reads them), one thread, against the
unpacked path (the few-row kernel of :mod:`.cpu_native`, else ``F.linear``), at
1 / 8 / 32 / 64 / 512 rows: bench-medium MKL 1.13 / 1.56 / 1.25 / 1.18 / 1.11x, oneDNN 0.93 /
1.50 / 1.14 / 1.06 / 1.01x; bench-small MKL 1.31 / 1.33 / 1.25 / 1.16 / 1.08x, oneDNN 0.91 /
0.90 / 1.03 / 1.01 / 1.02x. There a packed weight takes this path at every row count. Both stay
float32: on this AMX/AVX-512-BF16 CPU their error against a float64 product is ~5e-7
relative, as ``F.linear``'s is (bfloat16 would be ~3e-3); :func:`pack_linear_weight` checks
each packed weight against ``F.linear`` and the tests check the error bound.

Batch size: MKL's pack call takes the row count ``m`` of the product, and ``_mkl_linear`` runs
the packed GEMM only when the input's rows equal the ``batch_size`` it is given (else it falls
back to ``F.linear`` on its ``ORI_W`` argument). The packed weight (matrix B) is valid for any
``m``: its size does not depend on ``m``, and PaddlePaddle packs its GRU weights with ``m = 1``
and multiplies any batch by them. So each weight is packed once, for :data:`PACK_ROWS` rows
(the blocking MKL picks follows that ``m``; see the constant), and every call passes its own
row count, so every step size takes the packed path. That is checked, not assumed: each
packed weight's product is compared with ``F.linear`` at several row counts when it is packed,
and a weight that disagrees stays float (with a warning).

Memory: ``_mkl_linear`` reads only the shape and dtype of ``ORI_W`` on the packed path, so a
one-float stand-in expanded to the weight's shape takes its place and the float weight is freed:
the packed buffer is resident at about the float weight's size (+0.1 MiB per weight), so
packing does not double the weights (a bench-medium engine: 675 MiB resident packed, 666 MiB
unpacked). A weight another module also holds (a tied LM head, whose table the embedding
lookup needs) is packed only where packed weights keep their float copies (below): the table
then is the head's float copy, so packing it costs what packing any other weight costs. Without
float copies it stays float, since packing it would keep two copies for under 1% of a step on
the Intel machine (the head of bench-medium is 0.6 of ~72 ms at 64 decodes); on the AMD EPYC,
where float copies are kept, the packed head took bench-medium's 64-row head from 13 to 6.4 ms
a step (oneDNN against ``F.linear``). MKL also reserves
~8 MiB of address space per packed weight that it never touches (``cblas_sgemm_pack_get_size``
is generous): virtual, never resident (+0.6 GiB of address space for bench-medium's 72).

oneDNN's (``PackedLinearWeight.fmt == "onednn"``): ``torch.ops.mkldnn._reorder_linear_weight``
packs a weight into oneDNN's blocked layout for the batch size it is given (any row count runs
on it: the same probe checks that) and ``torch.ops.mkldnn._linear_pointwise`` multiplies by it,
float32 throughout (torch's ``mkldnn.matmul.fp32_precision`` must stay ``none``: a bfloat16 or
tf32 setting would fail the packing check, and the weight would stay float). On an AMD EPYC
(AVX2, 2 cores) oneDNN is the faster one, where the Intel CPU above measured the opposite:
bench-medium's 72 linears, two threads, MKL / oneDNN ms at 4 / 16 / 24 / 32 / 64 / 128 / 512
rows: 45.0 / 38.3, 57.0 / 38.3, 59.7 / 35.2, 68.7 / 42.2, 89.1 / 69.3, 145.7 / 125.5, 466 / 471
(one thread: 1.43x oneDNN at 4 rows, 1.29x at 32, 1.10x at 64, even from 128). The packed
buffer is about the float weight's size, as MKL's is. It is packed for :data:`PACK_ROWS` rows
too: packed for 1, 16, 64, 256 or 2048 rows instead, the same linears ran within the noise at
1-1024 rows. The one-call decode stack
(:mod:`.cpu_stack`) calls MKL from C, so it runs over oneDNN weights only where every product
takes the float copy (at most :data:`FLOAT_COPY_MAX_ROWS` rows; :meth:`PackedLinearWeight.stack_rows`).

Few rows: MKL's packed GEMM is fast at every row count on Intel CPUs (above), but not
elsewhere. On an AMD EPYC (AVX2), bench-medium's linears at 1 / 2 / 4 / 8 / 16 rows took 22.6 /
32.7 / 50.2 / 47.9 / 73.4 ms on two threads packed, and 12.7 / 15.1 / 15.7 / 22.3 / 38.9 ms
through the few-row kernel on the row-major float weight (the weights' streaming floor there:
9.7 ms); MKL ran a one-row product on one thread and did not reuse a streamed weight across
rows. So where :func:`.cpu_prepack.float_copies_wanted` says so (not an Intel CPU, or
``INFLIGHT_CPU_FLOAT_COPY=1``), a packed weight also keeps its row-major float weight
(now in panels, below), and products of few rows take the few-row kernels on it: the linear
weights' memory doubles, which the load log line says. Such steps
also stay out of the CPU decode lanes (:func:`has_float_copies`): the few-row kernel already
runs on every thread, and bench-medium's 8- and 16-decode steps took 33.3 and 61.3 ms whole
against 37.4 and 77.2 split in two lanes (at 32 decodes the lanes win: 97.3 against 120.0 ms).

Panels (for those float copies) and column blocks (for MKL's packed weights): see
:mod:`.cpu_weight_layout`.

bfloat16 products (``INFLIGHT_CPU_PACK_FORMAT=onednn-bf16``, never the default): each weight
rounded to bfloat16 once and packed in oneDNN's layout; each product rounds its float32 input rows
to bfloat16, multiplies on AMX's tiles where the CPU has them (AVX-512-BF16 or converted lanes
elsewhere, where torch says oneDNN runs bfloat16 at all; else the engine refuses to start), and
returns the product rounded to bfloat16 (oneDNN's output takes its input's type) as float32 rows,
the bias added in float32. Everything else stays float32: the residual
stream, norms, attention and the KV cache. So a product is as close to F.linear as bfloat16's 8
significant bits allow (the probe's tolerance: :data:`PROBE_TOLERANCE`), the rest as exact as the
float32 engine, and greedy tokens may differ from it where two logits are that close. On the
2-core Xeon (AMX) the packed bfloat16 products ran the bench-medium shapes at 1.3-2.8 TFLOP/s at
64-256 rows against MKL's float32 packed GEMM's ~0.4 (``F.linear`` in bfloat16, unpacked: ~1.1-2.1);
at 8 rows ~0.5 against ~0.3. No float copies are kept (every product is bfloat16) and the one-call
decode stack, which calls MKL from C, stays off.

This module holds one packed weight, its product and the formats' ops; choosing a format for
this CPU and packing a whole model at load is :mod:`.cpu_prepack`'s. Knows nothing about the
model beyond a weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inflight.kernels.cpu_weight_layout import column_starts, mkl_table, to_panels

# The row count weights are packed for. MKL's packed layout is valid for any row count, but its
# blocking follows this one: packed for 8 or 32-37 rows, 64-row products ran 1.1-1.6x slower
# than F.linear (bench-medium's gate_up, one thread); packed for 256-2048 rows, every count
# from 1 to 512 ran at or near its best (bench-medium's linears: 1.1x F.linear at 1 row,
# 1.4-1.6x at 2-8, 1.2x at 32-64, 1.1x at 512).
PACK_ROWS = 512
# Row counts every packed weight is checked at (one row, a few, more than a vector's width).
PROBE_ROWS = (1, 3, 37)
# The packed formats (see the module docstring): MKL's cblas_sgemm_pack, oneDNN's blocked layout,
# and oneDNN's blocked layout of the weight rounded to bfloat16 (opt-in only, "bfloat16 products").
FLOAT32_FORMATS = ("mkl", "onednn")
PACK_FORMATS = (*FLOAT32_FORMATS, "onednn-bf16")
# The formats whose products are bfloat16: each weight rounded once, each input row rounded per
# product, accumulated in float32 (AMX's tile products where the CPU has them).
BF16_FORMATS = ("onednn-bf16",)
# How far a packed product may be from F.linear's: float32 formats round like F.linear (relative
# to the largest product); bfloat16 ones round the weight, the input and the product to 8
# significant bits (relative to the largest sum of the terms' magnitudes: ~3 x 2^-9 at most).
PROBE_TOLERANCE = {"mkl": 1e-4, "onednn": 1e-4, "onednn-bf16": 1e-2}
# Products of at most this many rows take the few-row kernel on a packed weight's float copy,
# when it has one. On the AMD EPYC of the module docstring, one thread: the few-row kernel 27 /
# 45 / 67 ms at 4 / 8 / 16 rows against 59 / 68 / 86 packed, even at 24 (112 / 104), behind at
# 32 (130 / 104); two threads: ahead at every count to 16 (39 / 73).
FLOAT_COPY_MAX_ROWS = 16
# Products of at most this many rows take the panel kernel on a packed weight's float copy in
# column panels (:func:`to_panels`; see :mod:`.cpu_weight_layout`): on the AMD EPYC there it ran
# bench-medium's 72 linears ahead of oneDNN's packed GEMM at every row count from 1 to 64, on
# one thread and on two, and even with it at 128 (also on an 8B-sized layer).
PANEL_MAX_ROWS = 64


@dataclass(frozen=True, slots=True)
class PackedLinearWeight:
    """A ``[out_features, in_features]`` float32 weight in MKL's or oneDNN's packed GEMM layout."""

    # Opaque (layout torch._mkldnn), one per column block (see "Column blocks" in
    # cpu_weight_layout): _mkl_reorder_linear_weight's, or _reorder_linear_weight's (always one block).
    packed: tuple[torch.Tensor, ...]
    stand_in: torch.Tensor  # one float expanded to [out_features, in_features]: the op's ORI_W
    # The row-major float weight [out_features, in_features], kept for products of at most
    # FLOAT_COPY_MAX_ROWS rows where the weight is shared (a tied LM head: the embedding's
    # table, see the module docstring); None: no such copy.
    float_rows: torch.Tensor | None = None
    fmt: str = "mkl"  # one of PACK_FORMATS: which op multiplies by ``packed``
    # The float weight in column panels (to_panels), kept instead of float_rows for an unshared
    # weight, for products of at most PANEL_MAX_ROWS rows; None: no such copy.
    panels: torch.Tensor | None = None
    starts: tuple[int, ...] = (0,)  # the first output column of each block of ``packed``
    # MKL's blocks for C (cpu_decode_stack.h's inflight_packed_gemm_f32): int64 [number of
    # blocks, each block's buffer address, each block's first column]; None for oneDNN's.
    mkl_table: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.stand_in.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Resident bytes: the packed buffer is the weight's size in its format (see module
        docstring), plus the float copy if kept."""
        copy = self.panels.numel() * 4 if self.panels is not None else 0
        packed = self.shape[0] * self.shape[1] * (2 if self.fmt in BF16_FORMATS else 4)
        return packed + (0 if self.float_rows is None else self.float_rows.numel() * 4) + copy

    @property
    def has_float_copy(self) -> bool:
        """The weight kept a float copy (row-major or in panels) for few-row products."""
        return self.float_rows is not None or self.panels is not None

    def float_copy_for(self, num_rows: int) -> torch.Tensor | None:
        """The row-major float copy when a ``num_rows``-row product should take the few-row kernel on it."""
        return self.float_rows if num_rows <= FLOAT_COPY_MAX_ROWS else None

    def panels_for(self, num_rows: int) -> torch.Tensor | None:
        """The panel copy when a ``num_rows``-row product should take the panel kernel on it."""
        return self.panels if num_rows <= PANEL_MAX_ROWS else None

    @property
    def stack_rows(self) -> int | None:
        """The most rows the one-call decode stack (which calls MKL from C) may multiply by this
        weight: None (any) for MKL's format; for oneDNN's, :data:`PANEL_MAX_ROWS` with a panel copy
        and :data:`FLOAT_COPY_MAX_ROWS` with a row-major one (those products take the panel or
        few-row kernel), 0 without either."""
        if self.fmt == "mkl":
            return None
        if self.panels is not None:
            return PANEL_MAX_ROWS
        return FLOAT_COPY_MAX_ROWS if self.float_rows is not None else 0


def mkl_packing_available() -> bool:
    """torch was built with MKL and has the packed-linear ops."""
    return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


def onednn_packing_available() -> bool:
    """torch was built with oneDNN and has the packed-linear ops."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def packing_available(fmt: str) -> bool:
    """torch has the ops of packed format ``fmt`` (for bfloat16 products: and oneDNN runs them
    natively on this CPU)."""
    if fmt == "mkl":
        return mkl_packing_available()
    if fmt == "onednn-bf16":
        return onednn_packing_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return fmt == "onednn" and onednn_packing_available()


def packed_linear(
    x: torch.Tensor,  # [num_rows, in_features] float32
    weight: PackedLinearWeight,
    bias: torch.Tensor | None = None,  # [out_features] float32
) -> torch.Tensor:  # [num_rows, out_features]
    """``x @ weight.T + bias`` on the packed weight (the spec: ``reference.linear`` on the
    float weight it was packed from)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"a prepacked linear takes float32 CPU input (got {x.dtype} on {x.device.type}).")
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    if weight.fmt == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed[0], bias, "none", [], "")
    if weight.fmt == "onednn-bf16":  # float32 in and out; the bias added in float32
        out = torch.ops.mkldnn._linear_pointwise(x.bfloat16(), weight.packed[0], None, "none", [], "").float()
        return out if bias is None else out.add_(bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if len(weight.packed) == 1:
        return torch.ops.mkl._mkl_linear(x, weight.packed[0], weight.stand_in, bias, rows)
    ends = (*weight.starts[1:], weight.shape[0])
    return torch.cat([torch.ops.mkl._mkl_linear(x, block, weight.stand_in[start:end],
                                                None if bias is None else bias[start:end], rows)
                      for block, start, end in zip(weight.packed, weight.starts, ends, strict=True)], dim=-1)


def has_float_copies(model: nn.Module) -> bool:
    """Some packed weight of ``model`` kept its float copy for few-row products."""
    return any(isinstance(w, PackedLinearWeight) and w.has_float_copy
               for w in (getattr(m, "weight", None) for m in model.modules()))  # fmt: skip


def has_column_blocks(model: nn.Module) -> bool:
    """Some packed weight of ``model`` is in more than one column block (its products are split
    over the threads; see "Column blocks" in :mod:`.cpu_weight_layout`)."""
    return any(isinstance(w, PackedLinearWeight) and len(w.packed) > 1
               for w in (getattr(m, "weight", None) for m in model.modules()))  # fmt: skip


def pack_linear_weight(weight: torch.Tensor, keep_float: bool = False, fmt: str = "mkl",
                       shared: bool = False, num_blocks: int = 1) -> PackedLinearWeight | None:
    """``weight`` packed in format ``fmt`` (keeping a float copy too when ``keep_float``: in
    column panels, or the weight itself, row-major, when ``shared`` with another module), MKL's
    in up to ``num_blocks`` column blocks (:func:`column_starts`), or ``None`` when its packed
    product does not match ``F.linear`` at :data:`PROBE_ROWS` rows (the float weight should then
    be kept)."""
    if fmt not in PACK_FORMATS:
        raise ValueError(f"unknown packed format {fmt!r} (use one of {', '.join(PACK_FORMATS)}).")
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        raise ValueError(f"only 2-D float32 CPU weights are packed (got {weight.dtype}, {tuple(weight.shape)}).")
    with torch.no_grad():
        w = weight.detach().contiguous()
        out_features, in_features = w.shape
        if fmt == "mkl":
            starts = column_starts(out_features, num_blocks)
            ends = (*starts[1:], out_features)
            packed = tuple(torch.ops.mkl._mkl_reorder_linear_weight(w[start:end].contiguous(), PACK_ROWS)
                           for start, end in zip(starts, ends, strict=True))
            table = mkl_table(packed, starts)
        else:
            rounded = w.bfloat16() if fmt in BF16_FORMATS else w
            starts, packed, table = (0,), (torch.ops.mkldnn._reorder_linear_weight(rounded, PACK_ROWS),), None
        result = PackedLinearWeight(packed, torch.zeros(1).expand(out_features, in_features),
                                    w if keep_float and shared else None, fmt,
                                    to_panels(w) if keep_float and not shared else None, starts, table)
        gen = torch.Generator().manual_seed(out_features * 31 + in_features)
        for rows in PROBE_ROWS:
            x = torch.randn(rows, in_features, generator=gen)
            want = F.linear(x, w)
            # bfloat16's error scales with the terms of each sum, not with a sum that cancels
            scale = float((x.abs() @ w.abs().T if fmt in BF16_FORMATS else want.abs()).max()) + 1e-30
            if float((packed_linear(x, result) - want).abs().max()) > PROBE_TOLERANCE[fmt] * scale:
                return None
    return result
