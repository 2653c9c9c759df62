"""The tensor-parallel step message's wire format, derived from a dataclass's fields.

:class:`RecordCodec` reads ``dataclasses.fields`` and the type hints of a frozen dataclass
once (nested dataclasses included) and turns a value into a flat list of int64 *header*
numbers and one int64 *payload* tensor, and back. Each field is carried by its type, never by
its name: a ``torch.Tensor`` as its dtype code, rank and shape in the header and its elements
in the payload (floating tensors bit for bit); an ``int``, ``bool`` or ``float`` as one header
number; a nested dataclass field by field; ``X | None`` with a presence flag first. A field of
any other type is refused with a ``TypeError`` naming it when the codec is built, so a field
added to the batch is either carried or stops the program; none is dropped silently.

:func:`frame` and :func:`unframe` put a header and payload into one fixed-size int64 message
(the payload inline when it fits, else in a second broadcast). Knows nothing about process
groups (:mod:`.comm` broadcasts the message) or about what the fields mean.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")
MAX_NDIM = 4  # tensors of higher rank are refused when sent
PREFIX_LEN = 3  # command, header length, payload length
# Dtypes a tensor may have, by wire code; floating ones travel as the integers of their bits.
DTYPES: tuple[torch.dtype, ...] = (
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
)
_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}


class Kind(enum.Enum):
    TENSOR = "tensor"
    INT = "int"
    BOOL = "bool"
    FLOAT = "float"
    RECORD = "record"


@dataclass(frozen=True, slots=True)
class Slot:
    """One field as the wire carries it."""

    name: str
    kind: Kind
    optional: bool
    record: type | None = None  # Kind.RECORD: the nested dataclass
    fields: tuple[Slot, ...] = ()  # Kind.RECORD: its slots


def slots_of(cls: type, seen: tuple[type, ...] = ()) -> tuple[Slot, ...]:
    """The slots of dataclass ``cls``; ``TypeError`` naming the first field the wire cannot carry."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass; the step message carries dataclasses")
    if cls in seen:
        raise TypeError(f"{cls.__name__} contains itself; the step message carries finite records")
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        where = f"{cls.__name__}.{f.name}"
        if not f.init:
            raise TypeError(f"{where} is not an __init__ field; the receiver could not rebuild it")
        out.append(_slot(f.name, hints[f.name], where, (*seen, cls)))
    return tuple(out)


def _slot(name: str, hint: Any, where: str, seen: tuple[type, ...]) -> Slot:
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"{where}: {hint!r} is a union; the step message carries X or X | None only")
        hint, optional = rest[0], True
    if hint is torch.Tensor:
        return Slot(name, Kind.TENSOR, optional)
    if hint is bool:  # before int: bool is an int
        return Slot(name, Kind.BOOL, optional)
    if hint is int:
        return Slot(name, Kind.INT, optional)
    if hint is float:
        return Slot(name, Kind.FLOAT, optional)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return Slot(name, Kind.RECORD, optional, hint, slots_of(hint, seen))
    raise TypeError(f"{where}: the tensor-parallel step message cannot carry {hint!r}; it carries "
                    "torch.Tensor, int, bool, float, dataclasses of those, and X | None of each")


def _capacity(slots: tuple[Slot, ...]) -> int:
    size = {Kind.TENSOR: 2 + MAX_NDIM, Kind.INT: 1, Kind.BOOL: 1, Kind.FLOAT: 1}
    return sum(int(s.optional) + (_capacity(s.fields) if s.kind is Kind.RECORD else size[s.kind]) for s in slots)


class RecordCodec(Generic[T]):
    """Encodes values of one dataclass type as (header, payload) and decodes them back."""

    def __init__(self, cls: type[T]) -> None:
        self.cls = cls
        self.slots = slots_of(cls)
        self.header_capacity = _capacity(self.slots)  # the most header numbers a value takes

    def encode(self, value: T) -> tuple[list[int], torch.Tensor]:
        """Header numbers and the payload: one int64 CPU tensor of every tensor's elements."""
        header: list[int] = []
        parts: list[torch.Tensor] = []
        _encode(self.slots, value, self.cls.__name__, header, parts)
        payload = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return header, payload

    def decode(self, header: list[int], payload: torch.Tensor) -> T:
        """The value whose ``encode`` gave ``header`` and ``payload``; tensors on ``payload``'s device."""
        numbers = iter(header)
        cursor = [0]
        mismatch = ValueError(f"a {self.cls.__name__} message that does not match its fields: "
                              "sender and receiver disagree")
        try:
            value = _decode(self.slots, self.cls, numbers, payload, cursor)
        except StopIteration:  # the header ran out
            raise mismatch from None
        if next(numbers, None) is not None or cursor[0] != payload.numel():
            raise mismatch
        return value


def _encode(slots: tuple[Slot, ...], value: Any, where: str, header: list[int], parts: list[torch.Tensor]) -> None:
    for s in slots:
        v = getattr(value, s.name)
        if s.optional:
            header.append(int(v is not None))
            if v is None:
                continue
        elif v is None:
            raise ValueError(f"{where}.{s.name} is None but its type is not optional")
        if s.kind is Kind.TENSOR:
            header.extend(_tensor_header(v, f"{where}.{s.name}"))
            parts.append(_to_wire(v))
        elif s.kind is Kind.RECORD:
            _encode(s.fields, v, f"{where}.{s.name}", header, parts)
        elif s.kind is Kind.FLOAT:
            header.append(struct.unpack("<q", struct.pack("<d", float(v)))[0])
        else:
            header.append(int(v))


def _tensor_header(t: torch.Tensor, where: str) -> list[int]:
    if t.dtype not in _CODES:
        raise ValueError(f"{where}: dtype {t.dtype} does not travel (one of {', '.join(map(str, DTYPES))})")
    if t.dim() > MAX_NDIM:
        raise ValueError(f"{where}: {t.dim()} dimensions; the step message carries at most {MAX_NDIM}")
    return [_CODES[t.dtype], t.dim(), *t.shape]


def _to_wire(t: torch.Tensor) -> torch.Tensor:  # [numel] int64 on the CPU
    flat = t.reshape(-1)
    if t.dtype in _BITS:
        flat = flat.view(_BITS[t.dtype])
    return flat.to("cpu", torch.int64)


def _from_wire(chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype in _BITS:
        return chunk.to(_BITS[dtype]).view(dtype)
    return chunk.to(dtype)


def _decode(slots: tuple[Slot, ...], cls: type, numbers: Iterator[int], payload: torch.Tensor,
            cursor: list[int]) -> Any:
    values: dict[str, Any] = {}
    for s in slots:
        if s.optional and not next(numbers):
            values[s.name] = None
        elif s.kind is Kind.TENSOR:
            dtype, ndim = DTYPES[next(numbers)], next(numbers)
            shape = [next(numbers) for _ in range(ndim)]
            n = math.prod(shape)
            if cursor[0] + n > payload.numel():
                raise StopIteration  # the payload ran out: a mismatch, as a short header is
            values[s.name] = _from_wire(payload[cursor[0] : cursor[0] + n], dtype).reshape(shape)
            cursor[0] += n
        elif s.kind is Kind.RECORD:
            assert s.record is not None
            values[s.name] = _decode(s.fields, s.record, numbers, payload, cursor)
        elif s.kind is Kind.FLOAT:
            values[s.name] = struct.unpack("<d", struct.pack("<q", next(numbers)))[0]
        elif s.kind is Kind.BOOL:
            values[s.name] = bool(next(numbers))
        else:
            values[s.name] = next(numbers)
    return cls(**values)


# -- one fixed-size message ---------------------------------------------------------------------
def frame(command: int, header: list[int], payload: torch.Tensor, length: int) -> tuple[torch.Tensor, bool]:
    """``[command, len(header), len(payload), *header, *payload]`` in ``length`` int64s, and whether
    the payload is inline; when it is not, the caller sends ``payload`` in a second message."""
    start = PREFIX_LEN + len(header)
    if start > length:
        raise ValueError(f"a step header of {len(header)} numbers does not fit a {length}-number message")
    message = torch.zeros(length, dtype=torch.int64)
    message[:start] = torch.tensor([command, len(header), payload.numel(), *header], dtype=torch.int64)
    inline = start + payload.numel() <= length
    if inline:
        message[start : start + payload.numel()] = payload
    return message, inline


def unframe(message: torch.Tensor) -> tuple[int, list[int], int, torch.Tensor | None]:
    """Command, header, payload length, and the payload when inline (None: a second message has it)."""
    command, header_len, payload_len = message[:PREFIX_LEN].tolist()
    start = PREFIX_LEN + header_len
    header = message[PREFIX_LEN:start].tolist()
    inline = start + payload_len <= message.numel()
    return command, header, payload_len, message[start : start + payload_len] if inline else None
