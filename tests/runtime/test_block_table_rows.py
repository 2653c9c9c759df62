"""Block tables kept between steps (worker/block_table_rows.py) stack exactly as tables copied
from scratch do, through growth, frees, requests leaving and coming back, and batches wider
and longer than the kept array; and a step whose tables did not change copies none."""

from __future__ import annotations

import random

import numpy as np

from inflight.runtime.worker.block_table_rows import BlockTableRows, stack_tables


def _check(rows: BlockTableRows, req_ids: list[str], tables: list[tuple[int, ...]]) -> None:
    got_table, got_lens = rows.stack(req_ids, tables)
    want_table, want_lens = stack_tables(tables)
    np.testing.assert_array_equal(got_lens, want_lens)
    np.testing.assert_array_equal(got_table, want_table)
    assert got_table.dtype == want_table.dtype == np.int32


def test_random_steps_stack_as_from_scratch() -> None:
    rng = random.Random(7)
    rows = BlockTableRows()
    live: dict[str, list[int]] = {}
    tables: dict[str, tuple[int, ...]] = {}  # each request's tuple, a new object only when it changed
    next_id = 0
    for _ in range(300):
        for _ in range(rng.randint(0, 12)):  # arrivals, some with long tables (a wide batch)
            live[f"r{next_id}"] = [rng.randrange(5000) for _ in range(rng.choice([0, 1, 3, 40, 130]))]
            next_id += 1
        for req_id in list(live):
            roll = rng.random()
            if roll < 0.05:  # finished
                del live[req_id]
                tables.pop(req_id, None)
            elif roll < 0.08:  # preempted and admitted again: freed, a new list, other blocks
                live[req_id] = [rng.randrange(5000) for _ in range(rng.randint(0, 20))]
            elif roll < 0.3:  # a block appended
                live[req_id].append(rng.randrange(5000))
        for req_id, ids in live.items():
            if tables.get(req_id) != tuple(ids):
                tables[req_id] = tuple(ids)
        batch = [r for r in live if rng.random() < 0.85]  # some sit a step out
        rng.shuffle(batch)
        _check(rows, batch, [tables[r] for r in batch])
    assert next_id > 64  # more requests came than the kept array first has rows for


def test_a_step_with_the_same_tables_copies_none() -> None:
    rows = BlockTableRows()
    tables = [tuple(range(i, i + 9)) for i in range(100)]
    req_ids = [f"r{i}" for i in range(100)]
    _check(rows, req_ids, tables)
    assert rows.num_rows_written == 100
    _check(rows, req_ids[::-1], tables[::-1])  # the same tables, in another order
    assert rows.num_rows_written == 100
    tables[5] = (*tables[5], 777)  # one block appended
    _check(rows, req_ids, tables)
    assert rows.num_rows_written == 101


def test_a_table_shorter_than_its_row_held_is_padded_with_block_zero() -> None:
    rows = BlockTableRows()
    _check(rows, ["a", "b"], [tuple(range(1, 31)), (4, 5)])
    _check(rows, ["c", "b"], [(9,), (4, 5)])  # "a" left: "c" may reuse its row
    _check(rows, ["b", "c"], [(4, 5), ()])  # "c" freed and empty again


def test_a_list_is_copied_every_time() -> None:
    """Only a tuple is known unchanged by being the same object: a list may change in place."""
    rows = BlockTableRows()
    table = [1, 2, 3]
    _check(rows, ["a"], [table])  # type: ignore[list-item]
    table[1] = 8
    _check(rows, ["a"], [table])  # type: ignore[list-item]


def test_one_request_twice_in_a_batch_is_stacked_from_scratch() -> None:
    rows = BlockTableRows()
    _check(rows, ["a", "a"], [(1, 2), (1, 2, 3)])
    _check(rows, ["a"], [(1, 2, 3)])
