"""Whether a spec's host KV tier fits its pod's memory: ``spec.engine.kvOffloadingSize`` (or
``--kv-offloading-size`` in ``extraArgs``) GiB of pinned host memory behind the prefix cache,
plus a margin for the runtime process itself, must fit ``spec.resources.memory`` (the pod's
memory request and limit) when that is set; else the pod would be OOM-killed when the tier
fills, long after the rollout looked healthy. A spec that does not fit is refused
(``ValueError``, a Degraded condition with reason InvalidSpec) naming both values.

Knows nothing about Kubernetes I/O or manifests.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

HOST_MEMORY_MARGIN_GIB = 2.0  # the runtime's own host memory: Python, tokenizer, weights staged while loading
_FLAG = "--kv-offloading-size"
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_FACTOR = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_bytes(value: str, what: str) -> float:
    """Bytes of a Kubernetes quantity such as ``32Gi``, ``64G`` or ``1000000``; ``ValueError`` naming ``what``."""
    match = _QUANTITY.match(value)
    if match is None:
        raise ValueError(f"{what} {value!r} is not a memory quantity such as 32Gi.")
    return float(match.group(1)) * _FACTOR[match.group(2)]


def offloading_gib(engine: dict[str, Any], extra_args: Sequence[str]) -> tuple[float, str] | None:
    """The host tier's GiB as the pod gets it (``extraArgs`` come last, so they win) and where it was
    set; None when neither sets it."""
    found: tuple[float, str] | None = None
    if engine.get("kv_offloading_size") is not None:
        found = (float(engine["kv_offloading_size"]), "spec.engine.kvOffloadingSize")
    for i, arg in enumerate(extra_args):
        if arg == _FLAG or arg.startswith(_FLAG + "="):
            text = arg.partition("=")[2] if "=" in arg else (extra_args[i + 1] if i + 1 < len(extra_args) else "")
            try:
                found = (float(text), f"spec.engine.extraArgs {_FLAG}")
            except ValueError:
                raise ValueError(f"spec.engine.extraArgs {_FLAG} needs a number of GiB (got {text!r}).") from None
    return found


def check_host_memory(engine: dict[str, Any], extra_args: Sequence[str], memory: str | None) -> None:
    """Refuse a host tier that cannot fit ``memory`` (``spec.resources.memory``; unset: not checked)."""
    tier = offloading_gib(engine, extra_args)
    if tier is None or memory is None:
        return
    gib, where = tier
    have = quantity_bytes(memory, "spec.resources.memory") / 2**30
    need = gib + HOST_MEMORY_MARGIN_GIB
    if have < need:
        raise ValueError(
            f"{where} ({gib:g} GiB of host KV tier) plus {HOST_MEMORY_MARGIN_GIB:g} GiB for the runtime itself "
            f"does not fit spec.resources.memory ({memory} = {have:.3g} GiB): raise resources.memory to at least "
            f"{need:g}Gi or lower the tier's size.")
