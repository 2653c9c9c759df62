"""ModelRunner: owns the model, the paged KV cache tensors and the step's input tensors.

It turns a :class:`SchedulerOutput` into one packed batch (one-token sequences first, then
prompt chunks), runs the decoder, and returns the final hidden states' logits for the
sequences that sample this step. It sizes the KV cache from the config (explicit block
count, the free-GPU-memory fraction on CUDA, or a capped default on the CPU). Knows nothing
about sampling or scheduling policy.

Under tensor parallelism every rank has a ModelRunner holding its shard of the weights and
of the KV cache (its KV heads, every block). Rank 0's runner also prepares the batch and
broadcasts it (:meth:`execute`); the other ranks' runners run what they receive
(:meth:`execute_received`). The block count is agreed across ranks (the minimum), so the
scheduler's one block table is valid on every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inflight import env_vars
from inflight.kernels.dispatch import get_kernel_ops
from inflight.runtime.config import EngineConfig
from inflight.runtime.cpu_lanes import DecodeLanes
from inflight.runtime.decode_graphs import DecodeGraphs, capture_sizes
from inflight.runtime.graph_backend import CudaGraphBackend, GraphBackend
from inflight.runtime.logit_rows import PromptLogprobSpan, logit_row_order
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.loader import Progress, load_hf_config
from inflight.runtime.model.quantization import LoadTarget, load_weights
from inflight.runtime.model.quantized import num_weights
from inflight.runtime.model.rope import build_rope_tables
from inflight.runtime.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from inflight.runtime.distributed.comm import StepTensors, TensorParallel
    from inflight.runtime.distributed.launcher import WorkerGroup

logger = logging.getLogger(__name__)

CPU_KV_CACHE_CAP_BYTES = 4 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, rank: int = 0, world_size: int = 1) -> torch.device:
    """The device of tensor-parallel ``rank``: ``cuda:rank`` on CUDA, the CPU otherwise."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; use device=cpu.")
    if name == "cuda" and world_size > 1:
        if torch.cuda.device_count() < world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} needs {world_size} GPUs; "
                f"{torch.cuda.device_count()} visible."
            )
        return torch.device("cuda", rank)
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    return torch.float32


# A step whose weight matmuls touch at least this many parameter x token products (~0.1
# GFLOP) runs on every core; tinier steps (a few decodes of a tiny model) keep one core for
# the event loop, since waking a second OpenMP thread per op costs about what it saves.
BIG_STEP_PARAM_TOKENS = 50_000_000


def cpu_thread_counts() -> tuple[int, int]:
    """Intra-op threads for small and for big steps on the CPU path.

    ``INFLIGHT_CPU_THREADS``, else ``OMP_NUM_THREADS``, fixes both. Otherwise small steps use
    one fewer than the usable cores and big steps use every core, but only when OpenMP waits
    passively (``OMP_WAIT_POLICY=PASSIVE``, which ``inflight.runtime`` sets before torch loads):
    with spinning waits every op's barrier stalls on a thread the OS has descheduled for the
    event loop (5-7x slower steps measured on a 2-core machine under a burst). Measured with
    the server under a 64-request burst on a 2-core machine, against one thread: small (7M)
    model +11% output tok/s and p99 TTFT 1.3 s instead of 2.2 s; medium (61M) +34% and 9.0 s
    instead of 14.9 s; TPOT p50 at 4 requests/s unchanged (16 ms). A higher threshold (1e9,
    2e8) measured in between.
    """
    for value in (env_vars.read_str("INFLIGHT_CPU_THREADS") or "", os.environ.get("OMP_NUM_THREADS", "")):
        if value.isdigit() and int(value) > 0:
            return int(value), int(value)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    small = max(1, usable - 1)
    passive = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
    return small, usable if passive else small


def cpu_lanes(big_step_threads: int) -> int:
    """Decode lanes on the CPU (:mod:`inflight.runtime.cpu_lanes`): ``INFLIGHT_CPU_LANES`` if
    set (0 or 1: off), else one per thread a big step may use."""
    value = env_vars.read_str("INFLIGHT_CPU_LANES") or ""
    return int(value) if value.isdigit() else big_step_threads


def cpu_threads() -> int:
    """Intra-op threads of a small CPU step (see :func:`cpu_thread_counts`)."""
    return cpu_thread_counts()[0]


@dataclass(frozen=True, slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    # Rows of the packed batch to compute logits for, laid out as inflight.runtime.logit_rows says.
    sample_indices: torch.Tensor  # [num_logit_rows]
    sampled_chunks: tuple[ScheduledChunk, ...]
    sample_counts: tuple[int, ...] = ()  # rows per sampled chunk: 1, or 1 + its drafts
    prompt_logprob_spans: tuple[PromptLogprobSpan, ...] = ()


class ModelRunner:
    """Runs the decoder over the paged KV cache."""

    def __init__(
        self, model_dir: str | Path, config: EngineConfig, progress: Progress | None = None,
        tp: TensorParallel | None = None, workers: WorkerGroup | None = None,
        graph_backend: GraphBackend | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.tp = tp
        self.workers = workers  # rank 0 of a tensor-parallel group: the other ranks' processes
        world = tp.world_size if tp is not None else 1
        self.device = resolve_device(config.device, tp.rank if tp is not None else 0, world)
        small, big = cpu_thread_counts()
        self._cpu_threads = (max(1, small // world), max(1, big // world)) if self.device.type == "cpu" else None
        self._threads_now = 0
        self._lanes: DecodeLanes | None = None
        if self._cpu_threads is not None:
            torch.set_num_threads(self._cpu_threads[0])
            num_lanes = cpu_lanes(self._cpu_threads[1]) if world == 1 else 0
            self._lanes = DecodeLanes(num_lanes) if num_lanes >= 2 else None
        elif world > 1:
            torch.cuda.set_device(self.device)
        hf_config = load_hf_config(model_dir)
        checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype)
        target = LoadTarget(self.model_dir, hf_config, self.device, self.dtype,  # packed weights go in first
                            get_kernel_ops(config.kernel_backend, self.device), tp is not None)
        self.model, self.hf_config, self.quantization, self.ops = load_weights(config.quantization, target, tp, progress)
        self.spec = self.model.spec
        self._num_params = num_weights(self.model)  # packed weights count as the float ones would
        self.num_local_kv_heads = self.model.layout.num_kv_heads
        self.block_size = config.block_size
        self.max_model_len = self._resolve_max_model_len(config)
        # [num_tables, max_model_len, head_dim]: one table, or Gemma 3's global and local ones
        self.cos_sin = build_rope_tables(self.hf_config, self.spec, self.max_model_len).to(self.device)
        self.num_kv_blocks = self._resolve_num_blocks(config)
        if tp is not None:
            self.num_kv_blocks = tp.agree_num_blocks(self.num_kv_blocks)
        shape = (self.num_kv_blocks, self.block_size, self.num_local_kv_heads, self.spec.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.spec.num_layers)
        ]
        if progress:
            progress(f"KV cache: {self.num_kv_blocks} blocks of {self.block_size} tokens "
                     f"({self.kv_cache_bytes / 2**20:.0f} MiB), kernels: {self.ops.name}")
        self.graphs = self._capture_graphs(config, graph_backend, progress)

    def _capture_graphs(
        self, config: EngineConfig, backend: GraphBackend | None, progress: Progress | None
    ) -> DecodeGraphs | None:
        """Decode graphs: on CUDA unless ``enforce_eager``, a tensor-parallel group or kernels
        that read tensors on the host; anywhere when a backend is given (the CPU tests)."""
        if backend is None:
            why_not = ("enforce_eager" if config.enforce_eager else "not CUDA" if self.device.type != "cuda"
                       else "tensor parallel" if self.tp is not None
                       else f"the {self.ops.name} kernels read tensors on the host" if not self.ops.graph_safe
                       else None)  # fmt: skip
            if why_not is not None:
                if self.device.type == "cuda":
                    logger.info("decode steps run eagerly (%s)", why_not)
                return None
            backend = CudaGraphBackend(self.device)
        elif not self.ops.graph_safe:
            raise ValueError(f"decode graphs need graph-safe kernels; the {self.ops.name} kernels read "
                             "tensors on the host (use the triton or cpu kernel backend)")
        graphs = DecodeGraphs(
            self._logits, backend, capture_sizes(config.max_num_sequences),
            -(-self.max_model_len // self.block_size), self.device,
        )  # fmt: skip
        with torch.inference_mode():
            stats = graphs.capture()
        if progress:
            progress(f"decode graphs ({backend.name}) for batch sizes up to {graphs.max_size}: "
                     f"{len(stats.sizes)} captured in {stats.capture_seconds:.1f} s, "
                     f"{stats.memory_bytes / 2**20:.0f} MiB")  # fmt: skip
        return graphs

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Float32 logits of every row (what a captured decode graph computes)."""
        hidden = self.model(input_ids, positions, self.cos_sin, self.kv_caches, meta, self.ops)
        logits = self.model.compute_logits(hidden, self.ops)
        assert logits is not None  # graphs run without tensor parallelism
        return logits

    # -- sizing ------------------------------------------------------------------------
    def _resolve_max_model_len(self, config: EngineConfig) -> int:
        limit = self.spec.max_position_embeddings  # a sliding window is enforced in attention, not here
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds what the model supports ({limit})."
            )
        return config.max_model_len

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block on this rank (its KV heads)."""
        elem = torch.finfo(self.dtype).bits // 8
        return 2 * self.spec.num_layers * self.block_size * self.num_local_kv_heads * self.spec.head_dim * elem

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.bytes_per_block

    def _resolve_num_blocks(self, config: EngineConfig) -> int:
        num = self._num_blocks_before_cap(config)
        if config.max_tokens_in_paged_kv_cache is not None:
            num = min(num, config.max_tokens_in_paged_kv_cache // self.block_size)
        return num

    def _num_blocks_before_cap(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * config.kv_cache_free_gpu_mem_fraction)
            num = budget // self.bytes_per_block
        else:
            wanted = config.max_num_sequences * -(-self.max_model_len // self.block_size)
            num = min(wanted, CPU_KV_CACHE_CAP_BYTES // self.bytes_per_block)
        if num < 1:
            raise ValueError("no memory left for even one KV block; lower max_model_len or free memory.")
        return int(num)

    # -- one step ----------------------------------------------------------------------
    def prepare(self, chunks: tuple[ScheduledChunk, ...]) -> BatchInputs:
        """Pack the scheduled chunks: one-token rows first (decode path), then prompt chunks.

        A speculating chunk (its last token plus drafts) becomes one decode row per token, each
        attending to the context up to and including itself: the KV of the whole chunk is
        stored before attention runs, so the rows are causal without a prefill kernel.
        """
        decodes = [c for c in chunks if c.num_tokens == 1 or c.draft_token_ids]
        prefills = [c for c in chunks if c.num_tokens > 1 and not c.draft_token_ids]
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        spans: list[PromptLogprobSpan] = []
        prompt_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_lens: list[int] = []
        q_starts: list[int] = [0]
        counts: list[int] = []
        for chunk in decodes + prefills:
            req, start, n = chunk.request, chunk.request.num_computed_tokens, chunk.num_tokens
            if chunk.draft_token_ids:
                ids.append(req.token_ids[start])
                ids.extend(chunk.draft_token_ids)
            else:
                ids.extend(req.token_ids[start : start + n])
            positions = range(start, start + n)
            pos.extend(positions)
            table = req.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in positions)
            if chunk.num_tokens == 1 or chunk.draft_token_ids:
                decode_tables.extend([table] * n)
                decode_lens.extend(range(start + 1, start + n + 1))
            else:
                prefill_lens.append(start + n)
                q_starts.append(q_starts[-1] + n)
            if chunk.sample:
                rows = n if chunk.draft_token_ids else 1
                sample_rows.extend(range(len(ids) - rows, len(ids)))
                sampled.append(chunk)
                counts.append(rows)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                count = min(start + n, req.num_prompt_tokens - 1) - start
                spans.append((chunk, start, count))
                prompt_rows.extend(range(len(ids) - n, len(ids) - n + count))
        up = self._upload
        meta = AttentionMetadata(
            slot_mapping=up(slots, torch.int64),
            num_decode_tokens=len(decode_lens),
            decode_block_tables=self._upload_tables(decode_tables),
            decode_context_lens=up(decode_lens, torch.int32),
            prefill_block_tables=self._upload_tables([c.request.block_ids for c in prefills]),
            prefill_query_start_loc=up(q_starts, torch.int32),
            prefill_context_lens=up(prefill_lens, torch.int32),
            num_prefills=len(prefills),
        )
        return BatchInputs(
            input_ids=up(ids, torch.int64),
            positions=up(pos, torch.int64),
            meta=meta,
            sample_indices=up(logit_row_order(sample_rows, prompt_rows), torch.int64),
            sampled_chunks=tuple(sampled),
            sample_counts=tuple(counts),
            prompt_logprob_spans=tuple(spans),
        )

    def _upload(self, values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor on the device: on CUDA through pinned memory with a
        non-blocking copy, so preparing a step never waits for the GPU to drain."""
        host = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _upload_tables(self, tables: list[list[int]]) -> torch.Tensor:  # [num_seqs, width] int32
        """Block tables padded with block 0 to the longest (a valid id, never read past a context)."""
        width = max((len(t) for t in tables), default=1)
        rows = [t + [0] * (width - len(t)) for t in tables]
        return self._upload(rows, torch.int32).reshape(len(tables), width)

    @torch.inference_mode()
    def execute(self, batch: BatchInputs) -> torch.Tensor:
        """Logits ``[num_sampled, vocab]`` (float32) for the sampling rows of ``batch``.

        Rank 0 of a tensor-parallel group first broadcasts the batch; any failure from then
        on leaves the ranks out of step, so it raises ``EngineFatalError``.
        """
        if self.graphs is not None and self.workers is None and self._graphable(batch):
            return self.graphs.run(batch.input_ids, batch.positions, batch.meta)[batch.sample_indices]
        if self.workers is None:
            # Rows of one speculating sequence read each other's KV: lanes may not split them.
            lanes_ok = all(count == 1 for count in batch.sample_counts)
            logits = self._forward(batch.input_ids, batch.positions, batch.meta, batch.sample_indices, lanes_ok)
        else:
            logits = self.workers.run_step(
                lambda: self._forward(batch.input_ids, batch.positions, batch.meta, batch.sample_indices),
                (batch.input_ids, batch.positions, batch.meta, batch.sample_indices),
            )
        assert logits is not None  # rank 0 always gets the gathered logits
        return logits

    def _graphable(self, batch: BatchInputs) -> bool:
        """A pure-decode step no larger than the largest captured size."""
        graphs, meta = self.graphs, batch.meta
        return (graphs is not None and meta.num_prefills == 0 and not batch.prompt_logprob_spans
                and graphs.padded_size(meta.num_decode_tokens) is not None)

    @torch.inference_mode()
    def execute_received(self, step: StepTensors) -> None:
        """Ranks 1..N-1: run a step broadcast by rank 0 (logits go to rank 0)."""
        self._forward(*step)

    def check_health(self) -> None:
        """Raise ``EngineFatalError`` if a tensor-parallel worker has died (rank 0)."""
        if self.workers is not None:
            self.workers.check()

    def close(self) -> None:
        """Stop the tensor-parallel workers and the decode lanes, if any (idempotent)."""
        if self.workers is not None:
            self.workers.close()
        if self._lanes is not None:
            self._lanes.close()

    def _set_cpu_threads(self, num_tokens: int) -> None:
        """Every core for a big step, one kept for the event loop otherwise (see cpu_thread_counts)."""
        small, big = self._cpu_threads  # type: ignore[misc]
        want = big if num_tokens * self._num_params >= BIG_STEP_PARAM_TOKENS else small
        if want != self._threads_now:
            torch.set_num_threads(want)
            self._threads_now = want

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 sample_indices: torch.Tensor, lanes_ok: bool = True) -> torch.Tensor | None:
        if self._cpu_threads is not None:
            if lanes_ok and self._lanes is not None and self._lanes.takes(meta, self._num_params):
                self._threads_now = 0  # the lanes set their own threads' counts
                return self._lanes.forward(input_ids, positions, meta, sample_indices, self._logits)
            self._set_cpu_threads(input_ids.shape[0])
        hidden = self.model(input_ids, positions, self.cos_sin, self.kv_caches, meta, self.ops)
        return self.model.compute_logits(hidden[sample_indices], self.ops)

