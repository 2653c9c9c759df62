"""The host KV tier's one allocation (inflight/runtime/worker/host_arena.py): the per-layer views
cover disjoint, aligned ranges of one buffer whose length is the bytes asked for (what CUDA
page-locks as one range, in place of one power-of-two-rounded pinned block per layer).
Page-locking itself needs CUDA (`python -m bench.host_arena_pin` checks it and measures the pinned
bytes against one pin_memory tensor per layer); here the layout and the views are checked.
"""

from __future__ import annotations

import pytest
import torch

from inflight.runtime.core.sched_output import KVCopies
from inflight.runtime.worker.host_arena import ALIGNMENT, PAGE, HostArena, plan_layout
from inflight.runtime.worker.kv_copies import HostKV


def _ranges(views: list[torch.Tensor]) -> list[tuple[int, int]]:
    return sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views)


def test_layout_packs_aligned_sizes_end_to_end() -> None:
    layout = plan_layout([512, 256, 1024])
    assert layout.offsets == (0, 512, 768) and layout.nbytes == 512 + 256 + 1024


@pytest.mark.parametrize("sizes", [[100, 3, 257, 0, 64], [1], [ALIGNMENT - 1] * 7, []])
def test_layout_of_ragged_sizes_is_aligned_disjoint_and_tight(sizes: list[int]) -> None:
    layout = plan_layout(sizes)
    ends = [o + s for o, s in zip(layout.offsets, layout.sizes, strict=True)]
    assert all(o % ALIGNMENT == 0 for o in layout.offsets)
    assert all(end <= nxt for end, nxt in zip(ends, layout.offsets[1:], strict=False)), "views overlap"
    assert all(nxt - end < ALIGNMENT for end, nxt in zip(ends, layout.offsets[1:], strict=False)), "slack"
    assert layout.nbytes == (ends[-1] if ends else 0)


def test_layout_refuses_a_bad_alignment_or_size() -> None:
    with pytest.raises(ValueError, match="not a power of two"):
        plan_layout([8], alignment=48)
    with pytest.raises(ValueError, match="-1 bytes"):
        plan_layout([8, -1])


def test_arena_views_are_disjoint_aligned_slices_of_one_buffer() -> None:
    shapes = [(5, 16, 2, 8), (5, 16, 2, 8), (3, 7), (4,)]
    dtypes = [torch.float16, torch.float16, torch.uint8, torch.float32]
    arena = HostArena(shapes, dtypes)
    assert not arena.pinned
    assert [tuple(v.shape) for v in arena.views] == shapes and [v.dtype for v in arena.views] == dtypes
    ranges = _ranges(arena.views)
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False)), "views overlap"
    base = arena.views[0].data_ptr()
    assert base % PAGE == 0, "the range to page-lock starts on a page"
    assert all(v.data_ptr() % ALIGNMENT == 0 for v in arena.views)
    assert all(v.untyped_storage().data_ptr() == arena.views[0].untyped_storage().data_ptr() for v in arena.views)
    assert ranges[-1][1] - base == arena.nbytes == 2 * 5 * 16 * 2 * 8 * 2 + ALIGNMENT + 4 * 4
    for i, view in enumerate(arena.views):  # writing one view leaves the others alone
        for other in arena.views:
            other.zero_()
        view.fill_(1)
        assert all(bool((o == 0).all()) for j, o in enumerate(arena.views) if j != i)


def test_host_kv_pool_is_one_buffer_of_exactly_its_bytes() -> None:
    """Layers of fp16 K/V (and an fp8 cache as bytes): the arena spans exactly ``host_bytes``."""
    caches = [[(torch.zeros(9, 16, 2, 8, dtype=torch.float16), torch.zeros(9, 16, 2, 8, dtype=torch.float16))
               for _ in range(3)],
              [(torch.zeros(9, 16, 1, 16, dtype=torch.float8_e4m3fn),) * 2]]  # fmt: skip
    host = HostKV(caches, num_slots=6)
    assert host.arena.nbytes == host.host_bytes == 6 * (3 * 2 * 16 * 2 * 8 * 2 + 2 * 16 * 16)
    assert [v.dtype for v in host.arena.views][-2:] == [torch.uint8, torch.uint8]
    for view in host.arena.views:  # the pool starts uninitialised, as torch.empty
        view.zero_()
    caches[0][1][0][4].fill_(3.0)
    host.run(KVCopies(copy_out=((4, 5),), copy_in=((5, 0),)))
    assert bool((caches[0][1][0][0] == 3.0).all()) and bool((host.arena.views[2][5] == 3.0).all())
    assert int(host.arena.views[2].count_nonzero()) == 16 * 2 * 8, "a copy reached another slot or layer"
