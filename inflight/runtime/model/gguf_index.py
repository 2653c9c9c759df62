"""A GGUF file's tensor table and metadata, read without parsing its big arrays, every count
checked before it is used.

The ``gguf`` package's ``GGUFReader`` turns every metadata value into numpy views, the
tokenizer's tens of thousands of strings included: 5-6 s per open for SmolLM2-135M on a
2-core machine, and about 1.5 KB of memory per string whatever the file declares (4M empty
strings: 6 GB). :func:`open_gguf` walks the header itself (the GGUF v2/v3 layout, either byte
order: key/value pairs, tensor infos, aligned data), keeps scalar and string values, steps over
arrays by their lengths and remembers where they lie, so :meth:`GGUFIndex.array` decodes one on
demand (the tokenizer's, when converting), and builds the tensors as ``gguf``'s own
``ReaderTensor`` with the shapes and dtypes ``GGUFReader`` gives them (quantized types: rows x
row bytes), views of one read-only memmap, so ``gguf.quants`` dequantizes them unchanged.

Every count, length, dimension and offset is checked against the bytes left in the file and
the bounds of :mod:`gguf_checks` before it becomes a loop or an allocation, so a file costs at
most about the memory of what it really holds; a refusal is one :class:`GGUFError` line naming
the field. Knows nothing about models: hyperparameters are checked by :mod:`gguf_info`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inflight.runtime.model.gguf_checks import (
    MAX_ALIGNMENT,
    MAX_ARRAY_ITEMS,
    MAX_DIMS,
    MAX_KEY_BYTES,
    MAX_KV_PAIRS,
    MAX_NESTING,
    MAX_STRING_ITEMS,
    MAX_TENSOR_NAME_BYTES,
    MAX_TENSORS,
    GGUFError,
    field_name,
    int_in,
    need_room,
)

_ITEMS = {  # GGML types whose data GGUFReader views as elements, not bytes
    "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
}  # fmt: skip
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset
_ARRAY_HEAD_BYTES = 4 + 8  # item type, count


@dataclass(frozen=True, slots=True)
class ArrayField:
    """Where a metadata array lies: its GGUF item type, item count and first item's offset."""

    item_type: int
    count: int
    offset: int


class GGUFIndex:
    """``values`` (metadata key -> scalar or string), ``arrays`` (key -> :class:`ArrayField`),
    ``tensors`` (``gguf``'s ``ReaderTensor``, in file order) and ``data_offset``, as
    ``GGUFReader`` finds them; ``GGUFError`` for anything that does not fit the file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self.data)
        self._size = len(self.data)
        self._offs = 0
        self._order = "<"
        self._field = "header"
        self._items_left = MAX_STRING_ITEMS
        self.values: dict[str, Any] = {}
        self.arrays: dict[str, ArrayField] = {}
        try:
            self._read_header()
        except GGUFError:
            raise
        except struct.error as exc:
            raise GGUFError(self.path, self._field, "the file ends inside it (a truncated or corrupt GGUF header)") from exc
        except (UnicodeDecodeError, OverflowError, IndexError, ValueError) as exc:
            raise GGUFError(self.path, self._field, f"a truncated or corrupt GGUF header ({exc})") from exc

    # -- the header ----------------------------------------------------------------------
    def _read_header(self) -> None:
        from gguf import GGUF_MAGIC, READER_SUPPORTED_VERSIONS

        if self._take("I") != GGUF_MAGIC:
            raise GGUFError(self.path, "header.magic", "not a GGUF file (bad magic)")
        self._field = "header.version"
        version = self._u32()
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self._order = ">"
            version = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in READER_SUPPORTED_VERSIONS:
            raise GGUFError(self.path, "header.version", f"GGUF version {version} is not supported")
        self._field = "header.tensor_count"
        num_tensors = self._u64()
        self._field = "header.kv_count"
        num_values = self._u64()
        need_room(self.path, "header.kv_count", num_values, _MIN_KV_BYTES, self._left(), MAX_KV_PAIRS)
        need_room(self.path, "header.tensor_count", num_tensors, _MIN_TENSOR_INFO_BYTES, self._left(), MAX_TENSORS)
        for i in range(num_values):
            self._read_pair(i)
        need_room(self.path, "header.tensor_count", num_tensors, _MIN_TENSOR_INFO_BYTES, self._left())
        infos = [self._tensor_info(i) for i in range(num_tensors)]
        seen: set[str] = set()
        for name, *_ in infos:
            if name in seen:
                raise GGUFError(self.path, f"tensor {field_name(name)}", "appears twice")
            seen.add(name)
        alignment = self._alignment()
        self.data_offset = -(-self._offs // alignment) * alignment
        self.tensors: list[Any] = [self._tensor(*info, alignment) for info in infos]

    def _read_pair(self, index: int) -> None:
        self._field = f"metadata key {index}"
        key = self._str(MAX_KEY_BYTES)
        self._field = field_name(key)
        kind = self._u32()
        if key in self.values or key in self.arrays:
            raise GGUFError(self.path, self._field, "appears twice")
        if kind == _ARRAY:
            self.arrays[key] = self._skip_array(1)
        else:
            self.values[key] = self._value(kind)

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._str()
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFError(self.path, self._field, f"unknown GGUF value type {kind}")
        return self._take(fmt)

    def _skip_array(self, depth: int) -> ArrayField:
        """Step over one array, checking its count against the file before looping over it."""
        if depth > MAX_NESTING:
            raise GGUFError(self.path, self._field, f"arrays nested deeper than {MAX_NESTING}")
        item, count = self._u32(), self._u64()
        start = self._offs
        fmt = _SCALARS.get(item)
        if fmt is not None:
            need_room(self.path, self._field, count, struct.calcsize(fmt), self._left())
            self._offs += count * struct.calcsize(fmt)
            return ArrayField(item, count, start)
        if item not in (_STRING, _ARRAY):
            raise GGUFError(self.path, self._field, f"an array of unknown GGUF value type {item}")
        need_room(self.path, self._field, count, 8 if item == _STRING else _ARRAY_HEAD_BYTES,
                  self._left(), MAX_ARRAY_ITEMS)  # fmt: skip
        if count > self._items_left:
            raise GGUFError(self.path, self._field, f"the file's arrays hold more than {MAX_STRING_ITEMS} "
                            "strings and arrays together")
        self._items_left -= count
        for _ in range(count):
            if item == _STRING:
                size = self._str_size(None)  # read first: it moves the cursor past the length
                self._offs += size
            else:
                self._skip_array(depth + 1)
        return ArrayField(item, count, start)

    def _tensor_info(self, index: int) -> tuple[str, list[int], int, int]:
        self._field = f"tensor {index}"
        name = self._str(MAX_TENSOR_NAME_BYTES)
        self._field = f"tensor {field_name(name)}"
        num_dims = self._u32()
        if not 1 <= num_dims <= MAX_DIMS:
            raise GGUFError(self.path, self._field, f"{num_dims} dimensions; a tensor has 1 to {MAX_DIMS}")
        dims = [self._u64() for _ in range(num_dims)]
        return name, dims, self._u32(), self._u64()

    def _alignment(self) -> int:
        from gguf import GGUF_DEFAULT_ALIGNMENT

        value = self.values.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        alignment = int_in(self.path, "general.alignment", value, 1, MAX_ALIGNMENT)
        if alignment & (alignment - 1):
            raise GGUFError(self.path, "general.alignment", f"{alignment} is not a power of two")
        return alignment

    def _tensor(self, name: str, dims: list[int], raw_type: int, offset: int, alignment: int) -> Any:
        """A ``ReaderTensor`` over the file's bytes, after its type, dims and extent are checked."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.gguf_reader import ReaderField, ReaderTensor
        from gguf.quants import quant_shape_to_byte_shape

        field = f"tensor {field_name(name)}"
        if raw_type not in GGMLQuantizationType._value2member_map_:
            raise GGUFError(self.path, field, f"unknown GGML tensor type {raw_type}")
        ggml_type = GGMLQuantizationType(raw_type)
        if not all(1 <= d < 1 << 63 for d in dims):  # an int64 in llama.cpp: >= 2^63 is negative
            raise GGUFError(self.path, field, f"dims {[_signed(d) for d in dims]}: each must be at least 1")
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if dims[0] % block_size:
            raise GGUFError(self.path, field, f"rows of {dims[0]} are not whole {ggml_type.name} blocks of {block_size}")
        n_elems = math.prod(dims)
        n_bytes = n_elems // block_size * type_size
        if offset % alignment:
            raise GGUFError(self.path, field, f"data offset {offset} is not a multiple of the alignment {alignment}")
        start = self.data_offset + offset
        if start + n_bytes > self._size:
            raise GGUFError(self.path, field, f"its {n_bytes} bytes at data offset {offset} run past the end "
                            f"of the file ({self._size} bytes)")
        shape: tuple[int, ...] = tuple(reversed(dims))
        item = _ITEMS.get(ggml_type.name)
        if item is None:
            data = self.data[start : start + n_bytes].reshape(quant_shape_to_byte_shape(shape, ggml_type))
        else:
            data = self.data[start : start + n_bytes].view(np.dtype(item).newbyteorder(self._order)).reshape(shape)
        return ReaderTensor(name=name, tensor_type=ggml_type, shape=np.array(dims, dtype=np.uint64),
                            n_elements=n_elems, n_bytes=n_bytes, data_offset=start, data=data,
                            field=ReaderField(0, name, [], []))  # fmt: skip

    # -- arrays, on demand -------------------------------------------------------------------
    def array(self, key: str) -> list[Any] | None:
        """The metadata array ``key`` as a list (strings, numbers or lists), ``None`` when absent."""
        spec = self.arrays.get(key)
        if spec is None:
            return None
        if spec.count > MAX_ARRAY_ITEMS:
            raise GGUFError(self.path, field_name(key), f"{spec.count} items, more than the {MAX_ARRAY_ITEMS} read")
        saved, self._offs, self._field = self._offs, spec.offset, field_name(key)
        try:
            return self._items(spec.item_type, spec.count)
        except UnicodeDecodeError as exc:
            raise GGUFError(self.path, self._field, f"an item that is not UTF-8 ({exc})") from exc
        finally:
            self._offs = saved

    def _items(self, item: int, count: int) -> list[Any]:
        fmt = _SCALARS.get(item)
        if fmt is not None:
            values = np.frombuffer(self._buf, np.dtype(self._order + fmt), count, self._offs).tolist()
            self._offs += count * struct.calcsize(fmt)
            return values
        if item == _STRING:
            return [self._str() for _ in range(count)]
        return [self._items(self._u32(), self._u64()) for _ in range(count)]

    # -- primitives --------------------------------------------------------------------------
    def _left(self) -> int:
        return self._size - self._offs

    def _take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self._order + fmt, self._buf, self._offs)
        self._offs += struct.calcsize(fmt)
        return value

    def _u32(self) -> int:
        return int(self._take("I"))

    def _u64(self) -> int:
        return int(self._take("Q"))

    def _str_size(self, limit: int | None) -> int:
        size = self._u64()
        if limit is not None and size > limit:
            raise GGUFError(self.path, self._field, f"a string of {size} bytes, more than the {limit} allowed")
        if size > self._left():
            raise GGUFError(self.path, self._field, f"a string of {size} bytes but only {self._left()} bytes "
                            "are left in the file (a truncated or corrupt GGUF header)")
        return size

    def _str(self, limit: int | None = None) -> str:
        size = self._str_size(limit)
        text = bytes(self._buf[self._offs : self._offs + size]).decode("utf-8")
        self._offs += size
        return text


def _signed(dim: int) -> int:
    return dim - (1 << 64) if dim >= 1 << 63 else dim


def open_gguf(path: str | Path) -> GGUFIndex:
    """A checked :class:`GGUFIndex` of ``path`` (either byte order)."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8 or head[:4] != b"GGUF":
        raise GGUFError(path, "header.magic", "not a GGUF file (bad magic)")
    return GGUFIndex(path)
