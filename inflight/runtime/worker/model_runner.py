"""ModelRunner: owns the model, the paged KV cache tensors and the step's input tensors.

It packs a step's chunks into one batch (:mod:`inflight.runtime.worker.batch_inputs`), runs the
decoder, and returns the final hidden states' logits for the sequences that sample this step
(or, for the pooling runner, the hidden states themselves: :meth:`ModelRunner.hidden_states`).
It sizes the KV cache from the config (:mod:`.kv_sizing`), counting the bytes of any other cache indexed by the
same block tables (a draft model's, :mod:`inflight.runtime.spec_decode.draft_proposer`), whose runner
loads its weights first and allocates its cache afterwards with the same block count. Knows
nothing about sampling or scheduling policy; where it runs is :mod:`.device_setup`.

With ``enable_lora`` it holds the LoRA adapters' device slots (:mod:`inflight.runtime.lora.slots`,
written through :meth:`ModelRunner.load_lora`, on every rank); a step with LoRA rows runs eagerly
and whole (no captured decode graph, no CPU decode lanes), a step without any runs as before.

Under tensor parallelism every rank has a ModelRunner holding its shard of the weights and
of the KV cache (its KV heads, every block). Rank 0's runner also prepares the batch and
broadcasts it (:meth:`execute`); the other ranks' runners run what they receive
(:meth:`execute_received`). The block count is agreed across ranks (the minimum), so the
scheduler's one block table is valid on every rank.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inflight.kernels import fp8_kv
from inflight.kernels.cpu_huge_pages import cache_zeros, huge_pages_sentence
from inflight.kernels.cpu_packed import FLOAT_COPY_MAX_ROWS, has_column_blocks, has_float_copies
from inflight.kernels.dispatch import get_kernel_ops
from inflight.runtime.config import EngineConfig
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.lora.peft_format import AdapterWeights
from inflight.runtime.lora.slots import LoRASlots, attach
from inflight.runtime.model import kv_scales
from inflight.runtime.model.batch import AttentionMetadata
from inflight.runtime.model.llama4 import check_chunk_size
from inflight.runtime.model.loader import Progress, load_hf_config
from inflight.runtime.model.mla_kv import allocate_mla_caches, check_mla_engine
from inflight.runtime.model.quantization import LoadTarget, load_weights
from inflight.runtime.model.quantized import num_weights
from inflight.runtime.model.rope import build_rope_tables
from inflight.runtime.worker import kv_sizing
from inflight.runtime.worker.batch_inputs import BatchInputs, prepare_batch
from inflight.runtime.worker.block_table_rows import BlockTableRows
from inflight.runtime.worker.cpu.allocator import keep_freed_memory
from inflight.runtime.worker.cpu.device_setup import (
    big_step,
    cpu_lanes,
    cpu_thread_counts,
    resolve_device,
    resolve_dtype,
    rows_outweigh_host,
)
from inflight.runtime.worker.cpu.lanes import DecodeLanes, row_cost_tokens
from inflight.runtime.worker.decode_graphs import DecodeGraphs, capture_sizes, collector_kept_out
from inflight.runtime.worker.graph_backend import CudaGraphBackend, GraphBackend
from inflight.runtime.worker.hybrid_cache import allocate_states, draft_scratch, keep_accepted_states, with_state_slots
from inflight.runtime.worker.kv_copies import HostKV, num_host_slots
from inflight.runtime.worker.kv_layout import grouped_caches, kv_groups_of
from inflight.runtime.worker.pipeline_step import stage_forward
from inflight.runtime.worker.vision_step import vision_step_of

if TYPE_CHECKING:
    from inflight.runtime.distributed.comm import StepTensors, TensorParallel
    from inflight.runtime.distributed.launcher import WorkerGroup

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs the decoder over the paged KV cache.

    ``kv_bytes_beside``: bytes per block of other caches indexed by the same block tables,
    counted when the block count is sized. ``allocate_kv=False`` loads the weights only; the
    owner then calls :meth:`allocate_kv_cache` with the block count. ``draft_states``: (rows that
    may speculate in one step, drafts a row), for a hybrid model's scratch states (worker/hybrid_cache.py).
    """

    def __init__(
        self, model_dir: str | Path, config: EngineConfig, progress: Progress | None = None,
        tp: TensorParallel | None = None, workers: WorkerGroup | None = None,
        graph_backend: GraphBackend | None = None, kv_bytes_beside: int = 0, allocate_kv: bool = True,
        draft_states: tuple[int, int] = (0, 0),
    ) -> None:
        self.model_dir = Path(model_dir)
        self.tp = tp
        self.workers = workers  # rank 0 of a tensor-parallel group: the other ranks' processes
        self.pp = tp.pipeline if tp is not None else None  # this rank's pipeline stage (distributed/pipeline.py)
        rank, world = ((self.pp.rank, self.pp.world_size) if self.pp is not None
                       else (tp.rank, tp.world_size) if tp is not None else (0, 1))  # fmt: skip
        self.device = resolve_device(config.device, rank, world)
        small, big = cpu_thread_counts()
        self._cpu_threads = (max(1, small // world), max(1, big // world)) if self.device.type == "cpu" else None
        self._lanes: DecodeLanes | None = None
        if self._cpu_threads is not None:
            torch.set_num_threads(self._cpu_threads[0])
            allocator = keep_freed_memory()
            if progress:
                progress(allocator)
        elif world > 1:
            torch.cuda.set_device(self.device)
        hf_config = load_hf_config(model_dir)
        checkpoint_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        self.dtype = resolve_dtype(config.dtype, self.device, checkpoint_dtype)
        target = LoadTarget(self.model_dir, hf_config, self.device, self.dtype,  # packed weights go in first
                            get_kernel_ops(config.kernel_backend, self.device), tp is not None, big,
                            self.pp.stage if self.pp is not None else None)  # fmt: skip
        model_tp = tp if tp is not None and tp.world_size > 1 else None  # a pipeline's stage may have one rank
        self.model, self.hf_config, self.quantization, self.ops = load_weights(config.quantization, target, model_tp,
                                                                               progress)  # fmt: skip
        self.spec = self.model.spec
        # the KV cache's dtype: the serving dtype, fp8 (one byte a value, per-layer scales) or bfloat16 under float32
        self.kv_dtype = fp8_kv.cache_dtype(config.kv_cache_dtype, self.dtype, self.device.type)
        scales_said = kv_scales.configure(self.model, self.kv_dtype, config.calculate_kv_scales)
        if scales_said is not None and rank == 0:
            logger.log(logging.WARNING if "scales 1.0" in scales_said else logging.INFO, "%s", scales_said)
        self._num_params = num_weights(self.model)  # packed weights count as the float ones would
        self.num_local_kv_heads = self.model.layout.num_kv_heads
        self.block_size = config.block_size
        self.table_rows = BlockTableRows()  # the last batch's block tables (worker/block_table_rows.py)
        check_chunk_size(self.spec, self.block_size)  # Llama 4's chunks must start on block boundaries
        check_mla_engine(self.spec, config.kv_cache_dtype, config.enable_lora)  # DeepSeek-V3's latent cache
        self.kv_groups = kv_groups_of(self.model, config)  # per-group KV tables (worker/kv_layout.py); None: one
        self._kv_bytes_per_token = self.bytes_per_block // self.block_size  # what attention reads a context token
        num_lanes = (cpu_lanes(self._cpu_threads[1], has_column_blocks(self.model))
                     if self._cpu_threads is not None and world == 1 and not self.spec.state_layers
                     else 0)  # lanes split rows, not a hybrid model's per-sequence states
        if num_lanes >= 2:  # steps the few-row kernel runs on every thread stay whole (measured: cpu_packed)
            self._lanes = DecodeLanes(num_lanes, FLOAT_COPY_MAX_ROWS + 1 if has_float_copies(self.model) else 0,
                                      row_cost_tokens(self._num_params, self._kv_bytes_per_token))
        self.max_model_len = kv_sizing.max_model_len(self.spec, config)
        # LoRA: the adapters' device slots, allocated before the KV cache is sized (issue 49)
        self.lora_slots = (LoRASlots(self.spec, self.model.layout, config.max_loras, config.max_lora_rank,
                                     self.device, self.dtype) if config.enable_lora else None)  # fmt: skip
        attach(self.model, self.lora_slots)
        # [num_tables, max_model_len, head_dim]: one table, or Gemma 3's global and local ones
        self.cos_sin = build_rope_tables(self.hf_config, self.spec, self.max_model_len).to(self.device)
        self.vision = vision_step_of(self.model, self.hf_config, world, config)  # Qwen2.5-VL's images
        self.num_kv_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None
        # decode graphs bake each layer's fp8 KV scales in: with scales still to come from the first
        # prompt, the capture waits for them (its arguments kept here until then)
        self._graphs_after_scales: tuple[EngineConfig, GraphBackend | None] | None = None
        # EAGLE-3 (spec_decode/eagle3.py): runs each step in execute's place, eagerly, collecting hidden states
        self.execute_hook: Callable[[BatchInputs], torch.Tensor] | None = None
        # a hybrid model's per-sequence states (worker/hybrid_cache.py), before the KV cache is sized;
        # state_slots (req_id -> slot) is filled by the engine's StatePool (core/state_pool.py)
        self.num_state_slots = config.max_num_sequences if self.spec.state_layers else 0
        self.draft_scratch = draft_scratch(self.spec, self.num_state_slots, draft_states)
        self.state_caches = allocate_states(self.spec, self.num_state_slots, self.device, self.dtype,
                                            self.draft_scratch)  # fmt: skip
        self.state_slots: dict[str, int] = {}
        if allocate_kv:
            num_blocks = kv_sizing.num_blocks(config, self.device, self.bytes_per_block + kv_bytes_beside,
                                             self.block_size, self.max_model_len)
            if tp is not None:
                num_blocks = tp.agree_num_blocks(num_blocks)
            self.allocate_kv_cache(num_blocks, config, graph_backend, progress)

    def allocate_kv_cache(
        self, num_blocks: int, config: EngineConfig, graph_backend: GraphBackend | None = None,
        progress: Progress | None = None,
    ) -> None:
        """Allocate the paged KV cache (``num_blocks`` blocks) and capture the decode graphs over it."""
        if self.kv_caches:
            raise RuntimeError("the KV cache is allocated already")
        self.num_kv_blocks = num_blocks
        shape = (num_blocks, self.block_size, self.num_local_kv_heads, self.spec.head_dim)
        if self.spec.mla is not None:  # (latent, roped key) pairs, what they save said in the log: model/mla_kv.py
            self.kv_caches = allocate_mla_caches(self.spec, self.model.layout.num_heads, len(self.model.layers),
                                                 (num_blocks, self.block_size), self.kv_dtype, self.device,
                                                 progress or logger.info)  # fmt: skip
        elif self.kv_groups is not None:  # one pool of every group's blocks, num_kv_blocks per group
            self.kv_caches = grouped_caches(self.kv_groups, (num_blocks * self.kv_groups.num_groups, *shape[1:]),
                                            self.kv_dtype, self.device)  # fmt: skip
        else:
            self.kv_caches = [
                self.state_caches[i] if i in self.state_caches else  # a hybrid model's linear layer: its states
                (cache_zeros(shape, self.kv_dtype, self.device), cache_zeros(shape, self.kv_dtype, self.device))
                for i in range(len(self.model.layers))  # a pipeline stage's own layers only
            ]
        if progress:
            progress(f"KV cache: {self.num_kv_blocks} blocks of {self.block_size} tokens "
                     f"({self.kv_cache_bytes / 2**20:.0f} MiB, {str(self.kv_dtype).removeprefix('torch.')}"
                     f"{', ' + huge_pages_sentence() if self.device.type == 'cpu' else ''}), "
                     f"kernels: {self.ops.name}")  # fmt: skip
        if kv_scales.pending(self.model):
            self._graphs_after_scales = (config, graph_backend)
        else:
            self.graphs = self._capture_graphs(config, graph_backend, progress)

    def _capture_graphs(
        self, config: EngineConfig, backend: GraphBackend | None, progress: Progress | None
    ) -> DecodeGraphs | None:
        """Decode graphs: on CUDA unless ``enforce_eager``, a tensor-parallel group or kernels
        that read tensors on the host; anywhere when a backend is given (the CPU tests)."""
        if self.spec.head != "lm" or config.runner == "pooling":  # pooling steps are prompt chunks only
            return None
        if backend is None:
            why_not = ("enforce_eager" if config.enforce_eager else "not CUDA" if self.device.type != "cuda"
                       else "tensor parallel" if self.tp is not None
                       else f"{self.spec.arch} keeps per-sequence state (a hybrid model)" if self.state_caches
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
            _weak_logits(self), backend, capture_sizes(config.max_num_sequences),
            -(-self.max_model_len // self.block_size), self.device,
            self.kv_groups.num_groups if self.kv_groups is not None else 0,  # per-group KV tables: each group's
        )  # fmt: skip
        with collector_kept_out(), torch.inference_mode():
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
    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of this runner's cache on this rank (:func:`.kv_sizing.block_bytes`)."""
        layers = len(self.model.layers) if self.kv_groups is None else self.kv_groups.num_cache_layers
        return kv_sizing.block_bytes(self.spec, layers, self.block_size, self.num_local_kv_heads, self.kv_dtype)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_kv_blocks * self.bytes_per_block

    @property
    def resolved(self) -> dict[str, str]:
        """What ``auto`` turned into on this machine: device, dtype, kernel backend, quantization."""
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "kernel_backend": self.ops.name, "quantization": self.quantization.method}

    @property
    def device_busy_seconds(self) -> float | None:
        """Seconds the device spent executing (NVML's utilisation over time); None: not measured here."""
        return None

    def host_kv(self, size_gib: float, beside: Sequence[ModelRunner] = ()) -> HostKV:
        """The host tier's pool (``kv_offloading_size`` GiB) for this cache and ``beside``'s (a draft
        model's, indexed by the same block tables): :mod:`inflight.runtime.worker.kv_copies`."""
        bytes_per_block = self.bytes_per_block + sum(r.bytes_per_block for r in beside)
        return HostKV([self.kv_caches, *(r.kv_caches for r in beside)], num_host_slots(size_gib, bytes_per_block))

    # -- one step ----------------------------------------------------------------------
    def prepare(self, chunks: tuple[ScheduledChunk, ...], lora_slots: dict[int, int] | None = None) -> BatchInputs:
        """Pack the scheduled chunks (see :func:`inflight.runtime.worker.batch_inputs.prepare_batch`)."""
        batch = prepare_batch(chunks, self.block_size, self.device, lora_slots, self.table_rows)
        if self.vision is not None:  # M-RoPE positions and image rows (worker/vision_step.py)
            return self.vision.plan(batch, chunks, self.device)
        if not self.state_caches:
            return batch
        return with_state_slots(batch, chunks, self.state_slots, self.device, self.draft_scratch)

    def keep_accepted_states(self, chunks: Sequence[ScheduledChunk], accepted: Mapping[str, int]) -> None:
        """A hybrid model's speculating chunks of the step just run keep the state after their last
        accepted token (``accepted``: req_id -> drafts kept); nothing for other models."""
        if self.state_caches:
            keep_accepted_states(self.state_caches, chunks, accepted, self.state_slots, self.draft_scratch)

    def load_lora(self, slot: int, weights: AdapterWeights) -> None:
        """Write a LoRA adapter into device slot ``slot`` (every rank's shard under tensor parallelism)."""
        if self.lora_slots is None:
            raise RuntimeError("LoRA is not enabled on this runner")
        self.lora_slots.load(slot, weights.tensors)
        if self.workers is not None:
            self.workers.load_lora(slot, weights.tensors)

    @torch.inference_mode()
    def execute(self, batch: BatchInputs) -> torch.Tensor:
        """Logits ``[num_sampled, vocab]`` (float32) for the sampling rows of ``batch``.

        Rank 0 of a tensor-parallel group first broadcasts the batch; any failure from then
        on leaves the ranks out of step, so it raises ``EngineFatalError``.
        """
        if self.execute_hook is not None:
            return self.execute_hook(batch)
        if self.vision is not None:
            return self.vision.execute(self, batch)
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
        if self._graphs_after_scales is not None and not kv_scales.pending(self.model):
            config, backend = self._graphs_after_scales
            self._graphs_after_scales = None
            self.graphs = self._capture_graphs(config, backend, None)  # the fp8 KV scales are set now
        return logits

    @torch.inference_mode()
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:  # [num_tokens, hidden], final-normed
        """Run the decoder over a packed batch (one rank, eagerly): the pooling runner's forward."""
        if self.workers is not None:
            raise RuntimeError("the pooling runner runs on one rank")
        if self._cpu_threads is not None:
            self._set_cpu_threads(input_ids.shape[0])
        return self.model(input_ids, positions, self.cos_sin, self.kv_caches, meta, self.ops)

    def _graphable(self, batch: BatchInputs) -> bool:
        """A pure-decode step no larger than the largest captured size."""
        graphs, meta = self.graphs, batch.meta
        return (graphs is not None and meta.num_prefills == 0 and not batch.prompt_logprob_spans
                and meta.token_slots is None  # LoRA steps run eagerly (the graphs hold no token slots)
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

    def _set_cpu_threads(self, num_tokens: int, meta: AttentionMetadata | None = None,
                         num_streamed: int | None = None, light_rows: bool = False) -> None:
        """Every core for a big step, one kept for the host otherwise (see device_setup.big_step);
        ``light_rows``: the step's rows are already known to fall short of the rows' work floor.

        Compared with what torch has now, not with what this runner set last: lanes and
        another runner in the process (a draft model's) set it too."""
        small, big = self._cpu_threads  # type: ignore[misc]
        contexts = None if meta is None else meta.decode_context_lens
        want = small if light_rows or not big_step(num_tokens, self._num_params, num_streamed, contexts,
                                                    self._kv_bytes_per_token) else big  # fmt: skip
        if want != torch.get_num_threads():
            torch.set_num_threads(want)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 sample_indices: torch.Tensor, lanes_ok: bool = True) -> torch.Tensor | None:
        if self.pp is not None:  # this rank's stage; logits on rank 0 only (worker/pipeline_step.py)
            return stage_forward(self, input_ids, positions, meta, sample_indices)
        if self._cpu_threads is not None:
            light_rows = False
            if (lanes_ok and self._lanes is not None and meta.token_slots is None  # LoRA steps run whole
                    and self._lanes.takes(meta, self._num_params)):  # (lanes split rows, not their slots)
                if rows_outweigh_host(input_ids.shape[0], self._num_params, sample_indices.shape[0],
                                      meta.decode_context_lens, self._kv_bytes_per_token):
                    return self._lanes.forward(input_ids, positions, meta, sample_indices, self._logits)
                light_rows = True  # decided once: the step runs whole on the small count
            self._set_cpu_threads(input_ids.shape[0], meta, sample_indices.shape[0], light_rows)
        hidden = self.model(input_ids, positions, self.cos_sin, self.kv_caches, meta, self.ops)
        return self.model.compute_logits(hidden[sample_indices], self.ops)


def _weak_logits(runner: ModelRunner) -> Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]:
    """``runner._logits`` through a weak reference: the runner owns its graphs, and a graph
    holding the runner back would make a cycle that keeps the KV cache alive after the engine
    is dropped, until a cyclic-GC pass happens to run."""
    ref = weakref.ref(runner)

    def logits(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        live = ref()
        if live is None:
            raise RuntimeError("the model runner of these decode graphs is gone")
        return live._logits(input_ids, positions, meta)

    return logits
