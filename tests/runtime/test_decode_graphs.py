"""Decode graphs through the CPU stand-in backend: sizes, padding, buffer reuse, tokens equal
to eager for the four architectures, and the host-sync guard. The same tests with the real
CUDA backend carry the ``gpu`` marker (``make gpu-check`` runs them)."""

from __future__ import annotations

import pytest
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.engine import LLMEngine
from inflight.runtime.sampling_params import SamplingParams
from inflight.runtime.worker.decode_graphs import DecodeGraphs, capture_sizes
from inflight.runtime.worker.graph_backend import HostSyncError, RecordingGraphBackend, no_host_sync
from tests.devices import on_devices

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize(
    ("max_seqs", "sizes"),
    [(1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (20, (1, 2, 4, 8, 16, 20)),
     (64, (1, 2, 4, 8, 16, 32, 48, 64)), (10_000, (1, 2, 4, 8, *range(16, 513, 16)))],
)  # fmt: skip
def test_capture_sizes(max_seqs: int, sizes: tuple[int, ...]) -> None:
    assert capture_sizes(max_seqs) == sizes


def _graphs(num_blocks: int = 8, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[DecodeGraphs, list]:
    """DecodeGraphs over a fake model that records what each replay saw."""
    seen: list[dict[str, torch.Tensor]] = []

    def logits_fn(ids, positions, meta):  # a "model" that exposes its inputs
        seen.append({"ids": ids.clone(), "slots": meta.slot_mapping.clone(),
                     "lens": meta.decode_context_lens.clone(), "tables": meta.decode_block_tables.clone()})  # fmt: skip
        return torch.stack([ids.float(), positions.float()], dim=1)

    graphs = DecodeGraphs(logits_fn, RecordingGraphBackend(), sizes, num_blocks, torch.device("cpu"))
    graphs.capture()
    seen.clear()
    return graphs, seen


def _meta_for(n: int, width: int):
    from inflight.runtime.model.batch import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=torch.arange(n) + 100, num_decode_tokens=n,
        decode_block_tables=torch.arange(n * width, dtype=torch.int32).reshape(n, width) % 7,
        decode_context_lens=torch.arange(n, dtype=torch.int32) + 5,
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32), prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32), num_prefills=0,
    )  # fmt: skip


def test_padding_rows_write_nothing_and_attend_to_one_token() -> None:
    graphs, seen = _graphs()
    n = 3
    out = graphs.run(torch.arange(n) + 40, torch.arange(n) + 9, _meta_for(n, 2))
    assert graphs.padded_size(n) == 4 and len(seen) == 1
    step = seen[0]
    assert step["ids"].shape[0] == 4  # ran at the padded size
    assert step["slots"].tolist() == [100, 101, 102, -1]  # the padding row writes no KV
    assert step["lens"].tolist() == [5, 6, 7, 1]  # and attends to one token, never zero
    assert step["tables"].shape == (4, 8)  # the fixed table width
    assert out.shape == (n, 2) and out[:, 0].tolist() == [40.0, 41.0, 42.0]  # only real rows back


def test_buffers_are_reused_and_a_smaller_step_resets_stale_padding() -> None:
    graphs, seen = _graphs()
    buffers = [t.data_ptr() for t in (graphs.input_ids, graphs.slot_mapping, graphs.block_tables)]
    graphs.run(torch.arange(8), torch.arange(8), _meta_for(8, 3))
    graphs.run(torch.arange(5), torch.arange(5), _meta_for(5, 1))
    assert [t.data_ptr() for t in (graphs.input_ids, graphs.slot_mapping, graphs.block_tables)] == buffers
    assert seen[1]["slots"].tolist() == [100, 101, 102, 103, 104, -1, -1, -1]  # rows 5-7 were real last step
    assert seen[1]["lens"].tolist()[5:] == [1, 1, 1]
    assert graphs.backend.num_replays == 2 and len(graphs.backend.captured) == 4


def test_steps_the_graphs_cannot_take_are_refused() -> None:
    graphs, _ = _graphs(num_blocks=2)
    assert graphs.padded_size(9) is None
    with pytest.raises(ValueError, match="pure-decode"):
        graphs.run(torch.arange(9), torch.arange(9), _meta_for(9, 1))
    with pytest.raises(ValueError, match="exceeds"):
        graphs.run(torch.arange(2), torch.arange(2), _meta_for(2, 3))


def test_host_sync_inside_a_capture_fails() -> None:
    def syncing(ids, positions, meta):
        return ids.float()[: int(meta.decode_context_lens.max())]

    graphs = DecodeGraphs(syncing, RecordingGraphBackend(), (1, 2), 4, torch.device("cpu"))
    with pytest.raises(HostSyncError, match="__int__"):
        graphs.capture()
    x = torch.arange(4.0)
    for sync in (lambda: x.sum().item(), lambda: x.tolist(), lambda: bool(x.any()), lambda: x[x > 1],
                 lambda: x.nonzero(), lambda: x.to("cpu")):  # fmt: skip
        with pytest.raises(HostSyncError), no_host_sync():
            sync()
    with no_host_sync():  # device-side work is fine
        torch.where(x > 1, x, 0).sum()


def _generate(model_dir, device: str, backend, enforce_eager: bool = False, dtype: str = "float32"):
    kernels = "cpu" if device == "cpu" else "triton"
    config = EngineConfig(device=device, dtype=dtype, kernel_backend=kernels, num_kv_blocks=96,
                          max_num_sequences=8, max_num_tokens=64, enforce_eager=enforce_eager)  # fmt: skip
    engine = LLMEngine.from_model_dir(model_dir, config, graph_backend=backend)
    lengths = [3, 17, 9, 30, 1, 12, 5]  # finishing at different steps: the batch size shrinks
    for i, n in enumerate(lengths):
        prompt = [(7 * i + j) % 200 + 3 for j in range(n)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert engine.stats().num_used_kv_blocks == 0
    return tokens, engine


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_tokens_equal_eager_on_the_stand_in(model_factory, arch: str) -> None:
    model_dir = model_factory(arch)
    eager, engine = _generate(model_dir, "cpu", None)
    assert engine.runner.graphs is None  # the CPU is eager unless a backend is given
    backend = RecordingGraphBackend()
    graphed, engine = _generate(model_dir, "cpu", backend)
    assert graphed == eager
    assert len(backend.captured) == len(engine.runner.graphs.sizes) == 4  # sizes 1, 2, 4, 8
    assert backend.num_replays > 10  # most steps were pure decode


@pytest.mark.parametrize("device", on_devices("cuda"))
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_graph_tokens_equal_eager(model_factory, arch: str, device: str) -> None:
    model_dir = model_factory(arch)
    # float32: cuBLAS may pick another kernel for a padded batch, so bf16 rounding could differ.
    eager, engine = _generate(model_dir, device, None, enforce_eager=True)
    assert engine.runner.graphs is None
    graphed, engine = _generate(model_dir, device, None)
    assert engine.runner.graphs is not None and engine.runner.graphs.stats.memory_bytes >= 0
    assert graphed == eager
