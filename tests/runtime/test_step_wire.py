"""The tensor-parallel step message: its wire format is derived from the batch dataclasses' fields.

Values are built by walking ``dataclasses.fields`` (nested dataclasses included), so a field
added to :class:`StepInputs` or :class:`AttentionMetadata` is round-tripped here without
editing this file; a field of a type the wire cannot carry fails
``test_every_step_field_has_a_type_the_wire_carries``; a ``BatchInputs`` field that is
neither carried nor declared rank-0-only fails ``test_batch_inputs_fields_are_carried_or_rank0_only``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import typing
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from inflight.runtime.distributed import comm, wire
from inflight.runtime.model.batch import RANK0_ONLY_BATCH_FIELDS, AttentionMetadata, StepInputs


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 1e3).to(dtype)
        specials = torch.tensor([float("nan"), float("inf"), -0.0, 1e-30], dtype=dtype).flatten()
        flat = t.reshape(-1)
        flat[: min(len(specials), flat.numel())] = specials[: flat.numel()]
        return t
    info = torch.iinfo(dtype)
    t = torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, generator=g, dtype=torch.int64)
    return t.to(dtype)


def _build(cls: type, counter: itertools.count, dtypes: itertools.cycle) -> Any:
    """A value of dataclass ``cls`` with a distinct value in every field, found by walking its fields."""
    values = {}
    for slot in wire.slots_of(cls):
        n = next(counter)
        if slot.kind is wire.Kind.TENSOR:
            values[slot.name] = _tensor(next(dtypes), (2 + n % 3, 1 + n % 4)[: 1 + n % 2], seed=n)
        elif slot.kind is wire.Kind.RECORD:
            values[slot.name] = _build(slot.record, counter, dtypes)  # type: ignore[arg-type]
        elif slot.kind is wire.Kind.INT:
            values[slot.name] = -(2**40) + 7919 * n
        elif slot.kind is wire.Kind.BOOL:
            values[slot.name] = n % 2 == 1
        else:
            values[slot.name] = math.pi * n
    return cls(**values)


def _assert_same(got: Any, want: Any, where: str) -> None:
    """Field by field (walking ``dataclasses.fields``): same types, dtypes, shapes and bits."""
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        bits = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
                torch.bfloat16: torch.int16}.get(want.dtype)
        if bits is not None:
            got, want = got.contiguous().view(bits), want.contiguous().view(bits)
        assert torch.equal(got, want), where
    elif dataclasses.is_dataclass(want):
        for f in dataclasses.fields(want):
            _assert_same(getattr(got, f.name), getattr(want, f.name), f"{where}.{f.name}")
    else:
        assert got == want, where


@pytest.mark.parametrize("offset", range(len(wire.DTYPES)), ids=[str(d) for d in wire.DTYPES])
def test_every_step_field_round_trips(offset: int) -> None:
    """Each parametrization shifts which dtype each tensor field gets, so every field travels
    in every dtype the wire knows."""
    dtypes = itertools.cycle(wire.DTYPES[offset:] + wire.DTYPES[:offset])
    step = _build(StepInputs, itertools.count(1), dtypes)
    header, payload = comm.STEP_CODEC.encode(step)
    assert len(header) <= comm.STEP_CODEC.header_capacity
    _assert_same(comm.STEP_CODEC.decode(header, payload), step, "StepInputs")


def test_a_real_step_round_trips_through_one_message_or_two() -> None:
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 17, 18, 19], dtype=torch.int64), num_decode_tokens=1,
        decode_block_tables=torch.tensor([[0, 3]], dtype=torch.int32),
        decode_context_lens=torch.tensor([6], dtype=torch.int32),
        prefill_block_tables=torch.tensor([[1]], dtype=torch.int32),
        prefill_query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        prefill_context_lens=torch.tensor([3], dtype=torch.int32), num_prefills=1,
    )
    step = StepInputs(torch.tensor([9, 1, 2, 3]), torch.tensor([5, 0, 1, 2]), meta, torch.tensor([0, 3]))
    header, payload = comm.STEP_CODEC.encode(step)
    for length, inline in ((wire.PREFIX_LEN + len(header) + payload.numel(), True),
                           (wire.PREFIX_LEN + len(header) + payload.numel() - 1, False)):
        message, sent_inline = wire.frame(comm.CMD_STEP, header, payload, length)
        assert sent_inline is inline
        cmd, got_header, payload_len, got_payload = wire.unframe(message)
        assert (cmd, got_header, payload_len) == (comm.CMD_STEP, header, payload.numel())
        assert (got_payload is not None) is inline
        second = payload.clone()  # what the second broadcast carries
        _assert_same(comm.STEP_CODEC.decode(got_header, got_payload if inline else second), step, "step")


def test_a_header_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        wire.frame(comm.CMD_STEP, [0] * 10, torch.empty(0, dtype=torch.int64), wire.PREFIX_LEN + 9)


def _leaf_hints(cls: type, where: str) -> list[tuple[str, Any]]:
    out = []
    for name, hint in typing.get_type_hints(cls).items():
        inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            out += _leaf_hints(inner[0], f"{where}.{name}")
        else:
            out.append((f"{where}.{name}", hint))
    return out


@pytest.mark.parametrize("cls", [StepInputs, AttentionMetadata])
def test_every_step_field_has_a_type_the_wire_carries(cls: type) -> None:
    carried = {torch.Tensor, int, bool, float}
    for where, hint in _leaf_hints(cls, cls.__name__):
        inner = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        assert len(inner) == 1 and inner[0] in carried, (
            f"{where}: {hint!r} cannot travel in the tensor-parallel step message; carry it as a "
            "tensor or a scalar, or keep it in rank 0 (RANK0_ONLY_BATCH_FIELDS)")
    wire.slots_of(cls)  # and the codec agrees


def test_batch_inputs_fields_are_carried_or_rank0_only() -> None:
    from inflight.runtime.worker.model_runner import BatchInputs

    batch = typing.get_type_hints(BatchInputs)
    step = typing.get_type_hints(StepInputs)
    unknown = set(batch) - set(step) - set(RANK0_ONLY_BATCH_FIELDS)
    assert not unknown, (f"BatchInputs fields {sorted(unknown)} neither travel to the other ranks "
                         "(add them to StepInputs) nor are declared rank-0-only (RANK0_ONLY_BATCH_FIELDS)")
    assert set(step) <= set(batch) and set(RANK0_ONLY_BATCH_FIELDS) <= set(batch)
    assert all(batch[name] == step[name] for name in step)


@dataclass(frozen=True)
class _Tuple:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class _Union:
    x: int | torch.Tensor


@dataclass(frozen=True)
class _List:
    x: torch.Tensor
    rows: list[int] | None


@dataclass(frozen=True)
class _NotInit:
    x: int
    y: int = dataclasses.field(init=False, default=0)


@pytest.mark.parametrize("cls, field", [(_Tuple, "_Tuple.ids"), (_Union, "_Union.x"), (_List, "_List.rows"),
                                        (_NotInit, "_NotInit.y")])
def test_a_field_the_wire_cannot_carry_is_refused_by_name(cls: type, field: str) -> None:
    with pytest.raises(TypeError, match=field.replace(".", r"\.")):
        wire.RecordCodec(cls)


@dataclass(frozen=True)
class _Optional:
    a: torch.Tensor | None
    b: int | None
    c: float
    d: bool
    e: AttentionMetadata | None


@pytest.mark.parametrize("present", [False, True])
def test_optional_fields_and_scalars_round_trip(present: bool) -> None:
    meta = _build(AttentionMetadata, itertools.count(3), itertools.cycle([torch.int32]))
    value = _Optional(torch.arange(6).reshape(2, 3) if present else None, -5 if present else None, -0.1, True,
                      meta if present else None)
    codec = wire.RecordCodec(_Optional)
    _assert_same(codec.decode(*codec.encode(value)), value, "_Optional")


@pytest.mark.parametrize("tensor, match", [
    (torch.zeros(2, dtype=torch.complex64), "dtype"),
    (torch.zeros((1,) * (wire.MAX_NDIM + 1), dtype=torch.int64), "dimensions"),
])
def test_a_tensor_the_wire_cannot_carry_is_refused_when_sent(tensor: torch.Tensor, match: str) -> None:
    codec = wire.RecordCodec(_Optional)
    with pytest.raises(ValueError, match=match):
        codec.encode(_Optional(tensor, None, 0.0, False, None))


def test_none_in_a_field_that_is_not_optional_is_refused() -> None:
    meta = _build(AttentionMetadata, itertools.count(), itertools.cycle([torch.int32]))
    with pytest.raises(ValueError, match=r"StepInputs\.input_ids is None"):
        comm.STEP_CODEC.encode(StepInputs(None, torch.zeros(1), meta, torch.zeros(1)))  # type: ignore[arg-type]


def test_a_message_that_does_not_match_the_fields_is_refused() -> None:
    step = _build(StepInputs, itertools.count(), itertools.cycle([torch.int64]))
    header, payload = comm.STEP_CODEC.encode(step)
    for bad_header, bad_payload in ((header[:-1], payload), (header + [0], payload), (header, payload[:-1])):
        with pytest.raises(ValueError, match="does not match its fields"):
            comm.STEP_CODEC.decode(bad_header, bad_payload)
