"""The multi-LoRA delta: ``lora_delta``, the torch reference and the CPU path, and the input
checks every ``lora_delta`` kernel shares.

For every row ``t`` of a packed batch whose adapter slot ``s = token_slots[t]`` is not -1,
``out[t] += (x[t] @ a[s].T) @ b[s].T``: the LoRA shrink to the rank, then the expand, added in
place into the base projection's output (which may be a column slice of a wider tensor, e.g.
the q part of the fused qkv output). Rows are grouped by slot, so each slot present costs one
pair of matmuls over all of its rows (Punica/S-LoRA's segmented idea with torch ops); slots
with no rows cost nothing. It reads the slots on the host, so it cannot run inside a captured
CUDA graph: :mod:`inflight.kernels.triton_lora` is the graph-safe kernel.

Knows nothing about adapters, their files or their scaling (``lora_alpha / r`` is folded into
``b`` at load; a rank below the pool's is padded with zeros, which changes nothing).
"""

from __future__ import annotations

import torch

LORA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SLOT_DTYPES = (torch.int32, torch.int64)


def check_lora_inputs(
    x: torch.Tensor,  # [num_tokens, in_features]
    a: torch.Tensor,  # [num_slots, rank, in_features]
    b: torch.Tensor,  # [num_slots, out_features, rank]
    token_slots: torch.Tensor,  # [num_tokens] int32 (-1: no adapter)
    out: torch.Tensor,  # [num_tokens, out_features]
) -> None:
    """Shapes, dtypes and devices of :func:`lora_delta`'s arguments (``ValueError`` if wrong).
    Never reads a tensor's values, so it is safe on a graph-captured path."""
    for name, t, ndim, doc in (
        ("x", x, 2, "[num_tokens, in_features]"),
        ("a", a, 3, "[num_slots, rank, in_features]"),
        ("b", b, 3, "[num_slots, out_features, rank]"),
        ("token_slots", token_slots, 1, "[num_tokens]"),
        ("out", out, 2, "[num_tokens, out_features]"),
    ):
        if t.dim() != ndim:
            raise ValueError(f"lora_delta: {name} must be {doc} (got shape {tuple(t.shape)}).")
    num_tokens, in_features = x.shape
    num_slots, rank, _ = a.shape
    out_features = out.shape[1]
    if a.shape[2] != in_features or b.shape != (num_slots, out_features, rank):
        raise ValueError(
            f"lora_delta: a {tuple(a.shape)} and b {tuple(b.shape)} do not fit x {tuple(x.shape)} "
            f"and out {tuple(out.shape)} (a: [num_slots, rank, in], b: [num_slots, out, rank])."
        )
    if token_slots.shape[0] != num_tokens or out.shape[0] != num_tokens:
        raise ValueError(
            f"lora_delta: x, token_slots and out must have one row per token (got {num_tokens}, "
            f"{token_slots.shape[0]} and {out.shape[0]})."
        )
    if x.dtype not in LORA_DTYPES or any(t.dtype != x.dtype for t in (a, b, out)):
        raise ValueError(
            f"lora_delta: x, a, b and out must share one of float32/float16/bfloat16 (got "
            f"{x.dtype}, {a.dtype}, {b.dtype}, {out.dtype})."
        )
    if token_slots.dtype not in SLOT_DTYPES:
        raise ValueError(f"lora_delta: token_slots must be int32 or int64 (got {token_slots.dtype}).")
    if any(t.device != x.device for t in (a, b, token_slots, out)):
        raise ValueError("lora_delta: x, a, b, token_slots and out must be on one device.")


def lora_delta(
    x: torch.Tensor,  # [num_tokens, in_features]
    a: torch.Tensor,  # [num_slots, rank, in_features]: each slot's LoRA A
    b: torch.Tensor,  # [num_slots, out_features, rank]: each slot's LoRA B, scaling folded in
    token_slots: torch.Tensor,  # [num_tokens] int32: each row's slot, -1 for none
    out: torch.Tensor,  # [num_tokens, out_features], any strides: updated in place
) -> None:
    """``out[t] += (x[t] @ a[s].T) @ b[s].T`` for each row ``t`` with slot ``s >= 0``.

    Products and the sum with ``out`` run in float32; ``out`` is rounded to its dtype once.
    Rows with slot -1 are left untouched; a slot outside ``[-1, num_slots)`` is a ValueError.
    """
    check_lora_inputs(x, a, b, token_slots, out)
    num_tokens, num_slots = x.shape[0], a.shape[0]
    if num_tokens == 0:
        return
    slots = token_slots.long()
    lowest, highest = torch.aminmax(slots)
    if int(lowest) < -1 or int(highest) >= num_slots:
        raise ValueError(f"lora_delta: token_slots must lie in [-1, {num_slots}) (there are {num_slots} slots).")
    counts = torch.bincount(slots + 1, minlength=num_slots + 1).tolist()
    if counts[0] == num_tokens:  # no row has an adapter
        return
    # The adapted rows gathered once in slot order, so each slot's rows are one contiguous run.
    rows = torch.argsort(slots, stable=True)[counts[0] :]  # [num_adapted]
    xs = x.index_select(0, rows).float()  # [num_adapted, in_features]
    shrunk = torch.empty((rows.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
    delta = torch.empty((rows.shape[0], out.shape[1]), dtype=torch.float32, device=x.device)
    start = 0
    for s, n in enumerate(counts[1:]):
        if n:
            end = start + n
            torch.mm(xs[start:end], a[s].float().T, out=shrunk[start:end])
            torch.mm(shrunk[start:end], b[s].float().T, out=delta[start:end])
            start = end
    # index_put_, not index_add_/index_copy_: those are 10-20x slower into a column slice.
    if out.dtype == torch.float32:
        out.index_put_((rows,), delta, accumulate=True)
    else:
        out.index_put_((rows,), (out.index_select(0, rows).float() + delta).to(out.dtype))
