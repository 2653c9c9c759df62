"""The decode graphs' one shared logits buffer: every captured size writes rows of a single
``[largest size, vocab]`` float32 buffer (before, each size kept its own output: 5.1 GB at vocab
152k and 512 rows). On the CPU stand-in backend; the CUDA case carries the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch

from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.worker.decode_graphs import DecodeGraphs, capture_sizes, logits_buffer_bytes
from inflight.runtime.worker.graph_backend import RecordingGraphBackend

VOCAB = 11


def _fake_logits(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """``[n, VOCAB]``: row i is ``ids[i]`` plus 0..VOCAB-1 (so each row is recognisable)."""
    return ids.float()[:, None] + torch.arange(VOCAB, dtype=torch.float32, device=ids.device)[None, :]


def _meta(n: int, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.arange(n, device=device), num_decode_tokens=n,
        decode_block_tables=torch.zeros(n, 1, dtype=torch.int32, device=device),
        decode_context_lens=torch.ones(n, dtype=torch.int32, device=device),
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=device), num_prefills=0,
    )  # fmt: skip


def test_the_plan_one_buffer_for_the_largest_size():
    sizes = capture_sizes(512)
    assert logits_buffer_bytes(sizes, 152_064) == 512 * 152_064 * 4  # 0.31 GB
    assert logits_buffer_bytes(sizes, 152_064, shared=False) == sum(sizes) * 152_064 * 4
    assert logits_buffer_bytes(sizes, 152_064, shared=False) > 5.0e9  # what one output per size held
    assert logits_buffer_bytes((), 10) == 0


def _check_shared(device: torch.device, graphs: DecodeGraphs) -> None:
    graphs.capture()
    buf = graphs.logits_buffer
    assert buf is not None and buf.shape == (graphs.max_size, VOCAB) and buf.dtype == torch.float32
    for n in (1, 3, 8, 5, 2):
        ids = torch.arange(n, device=device) * 10 + 7
        out = graphs.run(ids, torch.zeros(n, dtype=torch.int64, device=device), _meta(n, device))
        assert out.data_ptr() == buf.data_ptr() and out.shape == (n, VOCAB)  # a view of the one buffer
        assert torch.equal(out.cpu(), _fake_logits(ids.cpu(), ids.cpu(), _meta(n, torch.device("cpu"))))
    assert graphs.logits_buffer is buf  # never reallocated


def test_every_size_writes_rows_of_one_buffer():
    backend = RecordingGraphBackend()
    graphs = DecodeGraphs(_fake_logits, backend, (1, 2, 4, 8), 1, torch.device("cpu"))
    _check_shared(torch.device("cpu"), graphs)
    assert len(backend.captured) == 4


def test_the_buffer_is_allocated_by_the_largest_size_first():
    graphs = DecodeGraphs(_fake_logits, RecordingGraphBackend(), (1, 2, 4), 1, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="largest size"):
        graphs._step_fn(2)()  # a smaller size before the largest: refused, never a short buffer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_share_one_logits_buffer():
    from inflight.runtime.worker.graph_backend import CudaGraphBackend

    dev = torch.device("cuda")
    graphs = DecodeGraphs(_fake_logits, CudaGraphBackend(dev), (1, 2, 4, 8), 1, dev)
    with torch.inference_mode():
        _check_shared(dev, graphs)
