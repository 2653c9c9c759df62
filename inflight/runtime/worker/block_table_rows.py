"""Block tables as one 2-D array, kept between steps, so packing a batch copies only what changed.

A request's block table grows by one entry every ``block_size`` tokens, so most steps it is what
it was the step before. Flattening every row's table into a fresh array each step costs Python
time in proportion to the whole batch's context (0.44 ms a step at 256 rows x 64 blocks, 4.1 ms
at 512 blocks, measured on this project's 2-core machine), which the host spends while the
device waits. :class:`BlockTableRows` keeps each request's table in a row of one array and
rewrites a row only when the request's table is another tuple than the one it copied: a
request's table tuple (``Request.block_table``) is the same object for as long as its blocks
are unchanged, a new one when a block is appended or the request's blocks were freed and
allocated again (preemption). So a step's table is one gather from the kept array.

:func:`stack_tables` is the same result made from scratch, for the passes without request ids
(a draft model's segments, the per-group tables of a hybrid model). Knows nothing about the
model, the scheduler or devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np

_FIRST_ROWS = 64
_FIRST_WIDTH = 16


def stack_tables(tables: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``tables`` as ``[num_tables, width]`` int32 rows padded with block 0 (a valid block: the
    kernels' torch references gather padding too, then mask it out), width at least 1; and each
    table's length (``[num_tables]`` int64)."""
    lens, width = _lens(tables)
    table = np.zeros((len(tables), width), dtype=np.int32)
    table[np.arange(width) < lens[:, None]] = np.fromiter(chain.from_iterable(tables), dtype=np.int32,
                                                          count=int(lens.sum()))  # fmt: skip
    return table, lens


def _lens(tables: Sequence[Sequence[int]]) -> tuple[np.ndarray, int]:
    """Each table's length (``[num_tables]`` int64) and the stacked width (at least 1)."""
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    return lens, max(1, int(lens.max())) if len(tables) else 1


class BlockTableRows:
    """The block tables of the requests in the last batch, one row each (one per model runner;
    used from one thread at a time)."""

    def __init__(self) -> None:
        self._array = np.zeros((_FIRST_ROWS, _FIRST_WIDTH), dtype=np.int32)  # [capacity, width]
        self._written = [0] * _FIRST_ROWS  # entries row r may hold other than 0
        self._free = list(range(_FIRST_ROWS - 1, -1, -1))
        self._rows: dict[str, tuple[int, Sequence[int]]] = {}  # req_id -> (row, the table it copied)
        self.num_rows_written = 0  # rows copied so far (the tests read how little a step copies)

    def __len__(self) -> int:
        return len(self._rows)

    def stack(self, req_ids: Sequence[str], tables: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """:func:`stack_tables` of ``tables`` (``tables[i]``: request ``req_ids[i]``'s table),
        copying only the tables not copied before as the same object. Requests of the last batch
        missing from this one give their rows back."""
        lens, width = _lens(tables)
        if width > self._array.shape[1]:
            self._widen(width)
        previous, current = self._rows, {}
        rows: list[int] = []
        for req_id, table in zip(req_ids, tables, strict=True):
            if req_id in current:  # one request twice in a batch: never expected; copy from scratch
                self._rows = {**previous, **current}
                return stack_tables(tables)
            kept = previous.pop(req_id, None)
            if kept is None:
                row = self._free.pop() if self._free else self._grow()
                self._write(row, table)
            else:
                row = kept[0]
                if kept[1] is not table or type(table) is not tuple:  # a list may have changed in place
                    self._write(row, table)
            current[req_id] = (row, table)
            rows.append(row)
        self._free.extend(row for row, _ in previous.values())
        self._rows = current
        return self._array[rows, :width], lens

    def _write(self, row: int, table: Sequence[int]) -> None:
        n, written = len(table), self._written[row]
        if n:
            self._array[row, :n] = table
        if written > n:
            self._array[row, n:written] = 0
        self._written[row] = n
        self.num_rows_written += 1

    def _grow(self) -> int:
        """Double the rows; one of the new ones, taken."""
        capacity = self._array.shape[0]
        grown = np.zeros((2 * capacity, self._array.shape[1]), dtype=np.int32)
        grown[:capacity] = self._array
        self._array = grown
        self._written.extend([0] * capacity)
        self._free.extend(range(2 * capacity - 1, capacity, -1))
        return capacity

    def _widen(self, width: int) -> None:
        wider = np.zeros((self._array.shape[0], max(width, 2 * self._array.shape[1])), dtype=np.int32)
        wider[:, : self._array.shape[1]] = self._array
        self._array = wider
