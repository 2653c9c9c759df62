"""A model's linear weights packed at load (:mod:`.cpu_packed` holds one packed weight and its
product): which packed format this CPU gets (:func:`pack_format`: MKL's on Intel CPUs, oneDNN's
elsewhere, ``INFLIGHT_CPU_PACK_FORMAT`` overriding), whether each packed weight keeps a float
copy for few-row products (:func:`float_copies_wanted`: on every CPU but Intel's), and the swap
of every float32 ``nn.Linear`` weight for its packed form, with the load log line
(:func:`prepack_detail`, :func:`prepack_linears`). The measurements behind each choice are in
:mod:`.cpu_packed`'s docstring. Knows nothing about the model beyond ``nn.Linear``; called by
the weight loader for models on the native CPU kernels (``INFLIGHT_CPU_PREPACK=0`` keeps the
weights unpacked).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from inflight import env_vars
from inflight.kernels import cpu_packed
from inflight.kernels.cpu_packed import (
    BF16_FORMATS,
    FLOAT32_FORMATS,
    FLOAT_COPY_MAX_ROWS,
    PACK_FORMATS,
    PANEL_MAX_ROWS,
    pack_linear_weight,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PackSummary:
    """What :func:`prepack_linears` did, for the load log line."""

    num_packed: int
    packed_bytes: int
    shared: tuple[str, ...]  # linears whose weight another module holds too (a tied LM head), left float
    disagreed: tuple[str, ...]  # linears whose packed product disagreed with F.linear: float
    float_copies: bool = False  # each packed weight kept its float weight for few-row products
    fmt: str = "mkl"  # the packed format (PACK_FORMATS)
    fmt_reason: str = ""  # why that format, for the log ("INFLIGHT_CPU_PACK_FORMAT", "AuthenticAMD CPU", ...)
    num_blocks: int = 1  # column blocks a wide enough weight is packed in (MKL's format)

    def describe(self) -> str:
        kept = (f"float weights kept for few-row products (in panels up to {PANEL_MAX_ROWS} rows; a shared "
                f"weight row-major up to {FLOAT_COPY_MAX_ROWS})" if self.float_copies
                else "float copies freed")
        name = {"mkl": "MKL", "onednn": "oneDNN", "onednn-bf16": "oneDNN, bfloat16 products"}.get(self.fmt, self.fmt)
        why = f" [{self.fmt_reason}]" if self.fmt_reason else ""
        blocks = f" in up to {self.num_blocks} column blocks" if self.num_blocks > 1 else ""
        text = (f"{self.num_packed} linears prepacked for {name}{why}{blocks} ({self.packed_bytes / 2**20:.0f} MiB, "
                f"{kept}")
        if self.shared:
            text += f"; {', '.join(self.shared)} kept float (shared)"
        if self.disagreed:
            text += f"; {len(self.disagreed)} kept float (packed product disagreed)"
        return text + ")"


def cpuinfo_line(*prefixes: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first line of ``cpuinfo`` that starts with one of ``prefixes``; None if none does."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(prefixes):
                return line
    except OSError:
        pass
    return None


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's ``vendor_id`` (``GenuineIntel``, ``AuthenticAMD``, ...); "" where none is listed."""
    line = cpuinfo_line("vendor_id", cpuinfo=cpuinfo)
    return "" if line is None else line.partition(":")[2].strip()


def float_copies_wanted(vendor: str | None = None) -> bool:
    """Whether packed weights keep a float copy for few-row products: ``INFLIGHT_CPU_FLOAT_COPY``
    (1 or 0) if set, else on every CPU but Intel's (see :mod:`.cpu_packed`'s docstring)."""
    setting = env_vars.read_int("INFLIGHT_CPU_FLOAT_COPY")
    if setting is not None:
        return setting != 0
    return (cpu_vendor() if vendor is None else vendor) != "GenuineIntel"


def pack_format(vendor: str | None = None) -> tuple[str, str]:
    """The packed format for this CPU and why: ``INFLIGHT_CPU_PACK_FORMAT`` (one of
    :data:`PACK_FORMATS`) if set, else MKL's on Intel CPUs and oneDNN's on every other (see
    :mod:`.cpu_packed`'s docstring)."""
    setting = (env_vars.read_str("INFLIGHT_CPU_PACK_FORMAT") or "").strip().lower()
    if setting:
        if setting not in PACK_FORMATS:
            raise ValueError(f"INFLIGHT_CPU_PACK_FORMAT must be one of {', '.join(PACK_FORMATS)} (got {setting!r}).")
        return setting, "INFLIGHT_CPU_PACK_FORMAT"
    vendor = cpu_vendor() if vendor is None else vendor
    return ("mkl" if vendor == "GenuineIntel" else "onednn"), f"{vendor or 'unknown'} CPU"


def prepack_detail(model: nn.Module, ops_name: str, device: torch.device, dtype: torch.dtype,
                   num_blocks: int = 1) -> str:
    """Prepack ``model``'s linears when it runs in float32 on the native CPU kernels (and
    ``INFLIGHT_CPU_PREPACK`` is not 0), in :func:`pack_format`'s format (the other one where
    torch lacks its ops; MKL's in up to ``num_blocks`` column blocks, one per thread a step
    may use); what was done, for the load log line ("" if nothing)."""
    if ops_name.startswith("cpu-native") and device.type == "cpu" and dtype != torch.float32:
        name = str(dtype).removeprefix("torch.")
        return (f"; linear weights unpacked, and attention, norms and rotary on the torch reference kernels "
                f"(the native CPU kernels take float32; this engine serves {name}, slower than float32 on the CPU; "
                "faster on AMX: float32 with INFLIGHT_CPU_PACK_FORMAT=onednn-bf16, docs/tuning.md)")
    if not (ops_name.startswith("cpu-native") and device.type == "cpu" and dtype == torch.float32):
        return ""
    if (env_vars.read_int("INFLIGHT_CPU_PREPACK") or 0) == 0:
        return "; linear weights unpacked (INFLIGHT_CPU_PREPACK=0)"
    fmt, why = pack_format()
    if not cpu_packed.packing_available(fmt) and fmt in BF16_FORMATS:  # asked for by name: never silently float32
        raise ValueError(f"INFLIGHT_CPU_PACK_FORMAT={fmt}: this torch or CPU cannot run oneDNN's bfloat16 "
                         "products (torch.ops.mkldnn._is_mkldnn_bf16_supported() is false)")
    if not cpu_packed.packing_available(fmt):
        other = next(f for f in FLOAT32_FORMATS if f != fmt)
        if not cpu_packed.packing_available(other):
            return "; linear weights unpacked (torch has neither MKL's nor oneDNN's packed GEMM)"
        fmt, why = other, f"torch has no {fmt} packed GEMM"
    keep_float = float_copies_wanted() and fmt not in BF16_FORMATS  # bfloat16 products at every row count
    return "; " + prepack_linears(model, keep_float, fmt, why, num_blocks).describe()


def prepack_linears(model: nn.Module, keep_float: bool = False, fmt: str = "mkl", fmt_reason: str = "",
                    num_blocks: int = 1) -> PackSummary:
    """Swap every float32 ``nn.Linear`` weight of ``model`` (on the CPU) for its form packed in
    ``fmt``, in place; the float weights are freed unless ``keep_float`` (then each packed weight
    holds its float weight for few-row products). A weight another module holds too (an LM head
    tied to the token embedding) is packed only with ``keep_float``: its float weight stays for
    the other module anyway and is then the packed weight's float copy, so packing it costs what
    packing any other weight costs; without float copies it would be a second copy, and it stays
    float, except in a bfloat16 format, where the copy is half the float weight's size and its
    products take AMX."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():  # noqa: SLF001 - who else holds each tensor
            if param is not None:
                holders[id(param)] = holders.get(id(param), 0) + 1
    num = packed_bytes = 0
    shared: list[str] = []
    disagreed: list[str] = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight") if isinstance(module, nn.Linear) else None  # noqa: SLF001
        if not (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
                and weight.device.type == "cpu" and weight.dim() == 2):
            continue
        if holders.get(id(weight), 0) > 1 and not keep_float and fmt not in BF16_FORMATS:
            shared.append(name)  # a second float32 copy; a bfloat16 one costs half and speeds every product
            continue
        packed = pack_linear_weight(weight, keep_float, fmt, shared=holders.get(id(weight), 0) > 1,
                                    num_blocks=num_blocks)
        if packed is None:
            disagreed.append(name)
            continue
        num += 1
        packed_bytes += packed.nbytes
        del module.weight  # the Parameter goes; a plain attribute the decoder passes to ops.linear
        module.weight = packed  # type: ignore[assignment]
    if disagreed:
        logger.warning("the %s packed product disagreed with F.linear for %s; those weights stay float", fmt, disagreed)
    return PackSummary(num, packed_bytes, tuple(shared), tuple(disagreed), keep_float and num > 0, fmt, fmt_reason,
                       num_blocks if fmt == "mkl" else 1)
