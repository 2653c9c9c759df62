"""A GGUF file's tensor table and scalar metadata, read without parsing its big arrays.

The ``gguf`` package's ``GGUFReader`` turns every metadata value into numpy views, the
tokenizer's tens of thousands of strings included: 5-6 s per open for SmolLM2-135M on a
2-core machine, paid at every model load. Loading needs the tensor table and a few scalars
only, so :func:`open_gguf` walks the header itself (the GGUF v2/v3 layout: key/value pairs,
tensor infos, aligned data), keeps scalar and string values, steps over arrays by their
lengths, and builds the tensors as ``gguf``'s own ``ReaderTensor`` with the shapes and dtypes
``GGUFReader`` gives them (quantized types: rows x row bytes), views of one read-only memmap,
so ``gguf.quants`` dequantizes them unchanged. A big-endian file is opened with
``GGUFReader``. Conversion, which needs the tokenizer's arrays, keeps ``GGUFReader``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

_ITEMS = {  # GGML types whose data GGUFReader views as elements, not bytes
    "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
}  # fmt: skip


class GGUFIndex:
    """``values`` (metadata key -> scalar or string; arrays left out), ``tensors`` (``gguf``'s
    ``ReaderTensor``, in file order) and ``data_offset``, as ``GGUFReader`` finds them."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, READER_SUPPORTED_VERSIONS

        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self.data)
        self._offs = 0
        try:
            self._read_header(GGUF_MAGIC, READER_SUPPORTED_VERSIONS, GGUF_DEFAULT_ALIGNMENT)
        except (struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: a truncated or corrupt GGUF header ({exc})") from exc

    def _read_header(self, magic: int, versions: Any, default_alignment: int) -> None:
        path = self.path
        if self._u32() != magic:
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        version = self._u32()
        if version not in versions:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        num_tensors, num_values = self._u64(), self._u64()
        self.values: dict[str, Any] = {}
        for _ in range(num_values):
            key = self._str()
            kind = self._u32()
            if key in self.values:
                raise ValueError(f"{path}: metadata key {key!r} appears twice")
            value = self._value(kind)
            if value is not _SKIPPED:
                self.values[key] = value
        infos = [(self._str(), [self._u64() for _ in range(self._u32())], self._u32(), self._u64())
                 for _ in range(num_tensors)]  # fmt: skip
        alignment = int(self.values.get("general.alignment", default_alignment))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
        self.data_offset = -(-self._offs // alignment) * alignment
        self.tensors: list[Any] = [self._tensor(*info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError(f"{path}: a tensor name appears twice")

    def _take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._offs)
        self._offs += struct.calcsize(fmt)
        return value

    def _u32(self) -> int:
        return int(self._take("<I"))

    def _u64(self) -> int:
        return int(self._take("<Q"))

    def _str(self) -> str:
        size = self._u64()
        text = bytes(self._buf[self._offs : self._offs + size]).decode("utf-8")
        self._offs += size
        return text

    def _value(self, kind: int) -> Any:
        from gguf import GGUFReader, GGUFValueType

        gtype = GGUFValueType(kind)
        if gtype == GGUFValueType.STRING:
            return self._str()
        if gtype == GGUFValueType.ARRAY:
            item = GGUFValueType(self._u32())
            count = self._u64()
            if item in GGUFReader.gguf_scalar_to_np:
                self._offs += count * np.dtype(GGUFReader.gguf_scalar_to_np[item]).itemsize
            elif item == GGUFValueType.STRING:  # the tokenizer's vocabulary and merges: by their lengths
                for _ in range(count):
                    size = self._u64()
                    self._offs += size
            else:  # nested arrays
                for _ in range(count):
                    self._value(item)
            return _SKIPPED
        dtype = np.dtype(GGUFReader.gguf_scalar_to_np[gtype]).newbyteorder("<")
        value = np.frombuffer(self._buf, dtype, 1, self._offs)[0]
        self._offs += dtype.itemsize
        return value.item()

    def _tensor(self, name: str, dims: list[int], raw_type: int, offset: int) -> Any:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.gguf_reader import ReaderField, ReaderTensor
        from gguf.quants import quant_shape_to_byte_shape

        ggml_type = GGMLQuantizationType(raw_type)
        n_elems = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = n_elems * type_size // block_size
        start = self.data_offset + offset
        shape: tuple[int, ...] = tuple(reversed(dims))
        item = _ITEMS.get(ggml_type.name)
        if item is None:
            data = self.data[start : start + n_bytes].reshape(quant_shape_to_byte_shape(shape, ggml_type))
        else:
            data = self.data[start : start + n_bytes].view(item).reshape(shape)
        return ReaderTensor(name=name, tensor_type=ggml_type, shape=np.array(dims, dtype=np.uint64),
                            n_elements=n_elems, n_bytes=n_bytes, data_offset=start, data=data,
                            field=ReaderField(0, name, [], []))  # fmt: skip


_SKIPPED = object()


def open_gguf(path: str | Path) -> Any:
    """A :class:`GGUFIndex` of ``path``; ``GGUFReader`` for a big-endian file."""
    from gguf import GGUF_MAGIC

    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or struct.unpack("<I", head[:4])[0] != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (bad magic)")
    if struct.unpack("<I", head[4:])[0] & 0xFFFF == 0:  # the version byte-swapped
        from gguf import GGUFReader

        return GGUFReader(str(path))
    return GGUFIndex(path)
