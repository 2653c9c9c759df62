"""The simulated device (``--device sim``): a timed stand-in for the forward pass and sampling.

:class:`SimRunner` answers the engine as :class:`~inflight.runtime.worker.model_runner.ModelRunner`
does (``prepare``, ``execute``, ``spec``, ``num_kv_blocks``...), so the front end, the engine
core, the scheduler, the KV accounting and the grammar masks all run unchanged. It loads no
weights and allocates no KV tensors (the block pool's accounting is the engine's, as always):
``prepare`` packs the batch for real (the host's work on a GPU too), ``execute`` holds its
thread for the step time a :class:`SimProfile` models, in ``time.sleep`` (the GIL released, as a
GPU kernel leaves the host free), and counts that time as the device's busy time
(:attr:`SimRunner.device_busy_seconds`: NVML's utilisation is its rate over wall time). With a host
KV tier (``kv_offloading_size``) its copies are counted and timed too
(:class:`~inflight.runtime.worker.kv_copies.SimHostKV`: bytes of the modelled bf16 KV over
``SimProfile.host_copy_gb_per_s``).

:class:`SimSampler` replaces the sampling: each row's token is a hash of (seed, position),
the seed being the request's ``seed``, else its generator's seed (an unseeded sampled request,
seeded by arrival as the real sampler's are), else a hash of its prompt (greedy), so the same
request gets the same tokens in any process mode. A constrained row draws among the tokens its
grammar's bitmask allows (the sampler's own masks, deferral included); ``min_tokens`` bans EOS
and stop ids as the real sampler does; the output processor applies the stop rules.
Knows nothing about scheduling or the server.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from inflight.runtime.config import EngineConfig
from inflight.runtime.core.sched_output import ScheduledChunk
from inflight.runtime.model.loader import Progress, load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config
from inflight.runtime.outputs import TokenLogprob
from inflight.runtime.worker.batch_inputs import BatchInputs, prepare_batch
from inflight.runtime.worker.block_table_rows import BlockTableRows
from inflight.runtime.worker.kv_copies import SimHostKV, num_host_slots
from inflight.runtime.worker.sampler import (
    PendingMasks,
    PendingSample,
    Sampler,
    SamplerOutput,
    SamplingRow,
    SettledMasks,
)

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_MAX_PROMPT_SEEDS = 8192  # prompts whose seed is kept (all forgotten at once past it)


@dataclass(frozen=True, slots=True)
class SimProfile:
    """Modelled time of one step: ``base_ms`` + ``decode_row_ms`` per decode row +
    ``prefill_token_ms`` per prompt token + ``attention_ms_per_1k_context`` per 1,000 tokens of
    context read (summed over the rows).

    Defaults: the committed H100 figures (``bench/results/gpu/nvidia-h100-80gb-hbm3.md``, a
    ~0.5B llama): graphed decode steps of 64 and 256 rows took 4.45 and 10.71 ms at a context of
    ~340 tokens (the roofline's K/V bytes); attention at ~90% of the 3006 GB/s copy bandwidth
    over 12 KiB of K/V per token is ~4.5 us per 1k tokens; a line through the two steps after
    that gives the base and the per-row cost. A prompt token is priced at the compute roofline
    (~1 GFLOP at ~1 PFLOP/s bf16, with a margin). ``host_copy_gb_per_s`` (not ms) prices the host
    KV tier's copies (:class:`~inflight.runtime.worker.kv_copies.SimHostKV`)."""

    base_ms: float = 2.36
    decode_row_ms: float = 0.0311
    prefill_token_ms: float = 0.002
    attention_ms_per_1k_context: float = 0.0045
    host_copy_gb_per_s: float = 25.0  # host-tier copies (kv_offloading_size): ~PCIe 5 x16 at 40% of its peak

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e6:
                raise ValueError(f"sim profile: {f.name} must be a number of ms >= 0 (got {value!r}).")

    @classmethod
    def load(cls, path: str | Path | None) -> SimProfile:
        """The profile in the JSON file ``path`` (any subset of the fields; keys starting with
        ``_`` are notes, e.g. where ``make gpu-check`` measured it), or the defaults."""
        if path is None:
            return cls()
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"sim_profile {str(path)!r}: cannot read a JSON object ({exc})") from None
        names = {f.name for f in fields(cls)}
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if not (isinstance(k, str) and k.startswith("_"))}
        if not isinstance(data, dict) or set(data) - names:
            raise ValueError(f"sim_profile {str(path)!r}: a JSON object with keys among {', '.join(sorted(names))}"
                             " (and notes under keys starting with _)")
        return cls(**data)

    def step_ms(self, num_decode_rows: int, num_prefill_tokens: int, num_context_tokens: int) -> float:
        return (self.base_ms + self.decode_row_ms * num_decode_rows + self.prefill_token_ms * num_prefill_tokens
                + self.attention_ms_per_1k_context * num_context_tokens / 1000)


@dataclass(frozen=True, slots=True)
class _Label:
    name: str
    method: str = "none"


class SimRunner:
    """A ModelRunner without a model (see module docstring). One step at a time, as on one stream."""

    workers = None  # never tensor parallel
    graphs = None

    def __init__(self, model_dir: str | Path, config: EngineConfig, progress: Progress | None = None) -> None:
        self.model_dir = Path(model_dir)
        self.profile = SimProfile.load(config.sim_profile)
        self.device = torch.device("cpu")  # where the host's tensors (inputs, generators) live
        self.dtype = torch.float32
        self.hf_config = load_hf_config(model_dir)
        self.spec = spec_from_hf_config(self.hf_config)
        self.ops = _Label("sim")
        self.quantization = _Label("sim")
        self.block_size = config.block_size
        self.table_rows = BlockTableRows()  # the last batch's block tables (worker/block_table_rows.py)
        limit = self.spec.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds what the model supports ({limit}).")
        self.max_model_len = config.max_model_len or limit
        num = config.num_kv_blocks or config.max_num_sequences * -(-self.max_model_len // self.block_size)
        if config.max_tokens_in_paged_kv_cache is not None:
            num = min(num, config.max_tokens_in_paged_kv_cache // self.block_size)
        self.num_kv_blocks = num
        self._busy_s = 0.0
        self._lock = threading.Lock()
        # The host side of a GPU engine runs its small host tensors on one thread: intra-op
        # OpenMP workers would spin after each tiny op and burn CPU a GPU host never spends.
        torch.set_num_threads(1)
        logger.warning("device sim: no weights loaded; tokens are simulated, steps take a modelled time")
        if progress:
            progress(f"simulated device: no weights loaded, no KV tensors; {num} KV blocks of {self.block_size} "
                     f"tokens; step time {self.profile}")

    @property
    def resolved(self) -> dict[str, str]:
        return {"device": "sim", "dtype": "none", "kernel_backend": "sim", "quantization": "none"}

    @property
    def device_busy_seconds(self) -> float:
        """Seconds the simulated device has spent executing steps (cumulative)."""
        with self._lock:
            return self._busy_s

    def host_kv(self, size_gib: float, beside: tuple[()] = ()) -> SimHostKV:
        """The host tier's stand-in: copies counted and timed (bf16 K and V of every layer)."""
        spec = self.spec
        bytes_per_block = 2 * spec.num_layers * self.block_size * spec.num_kv_heads * spec.head_dim * 2
        return SimHostKV(num_host_slots(size_gib, bytes_per_block), bytes_per_block,
                         self.profile.host_copy_gb_per_s, self._add_busy)

    def _add_busy(self, seconds: float) -> None:
        with self._lock:
            self._busy_s += seconds

    def new_sampler(self) -> SimSampler:
        return SimSampler(self.device, self.spec.vocab_size)

    def prepare(self, chunks: tuple[ScheduledChunk, ...]) -> BatchInputs:
        return prepare_batch(chunks, self.block_size, self.device, table_rows=self.table_rows)

    def execute(self, batch: BatchInputs) -> torch.Tensor:
        """Hold the thread for the modelled step time; logits ``[num_rows, vocab]`` of zeros (a view)."""
        meta = batch.meta
        num_decode = meta.num_decode_tokens
        context = int(meta.decode_context_lens.numpy().sum()) + int(meta.prefill_context_lens.numpy().sum())  # host
        seconds = self.profile.step_ms(num_decode, batch.input_ids.shape[0] - num_decode, context) / 1000
        start = time.monotonic()
        if seconds > 0:
            time.sleep(seconds)
        busy = time.monotonic() - start
        with self._lock:
            self._busy_s += busy
        return torch.zeros((1, 1)).expand(batch.sample_indices.shape[0], self.spec.vocab_size)

    def check_health(self) -> None:
        pass

    def close(self) -> None:
        pass


class SimSampler(Sampler):
    """Deterministic tokens for the simulated device (see module docstring); the grammar masks
    are the real sampler's (filled, waited for and deferred the same way)."""

    def __init__(self, device: torch.device, vocab_size: int) -> None:
        super().__init__(device)
        self.vocab_size = vocab_size
        # A greedy request's seed hashes its prompt: kept by the prompt list's id, with the list
        # itself, so the id cannot be reused while it is cached (prompts are never modified).
        self._prompt_seeds: dict[int, tuple[list[int], int]] = {}

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               masks: PendingMasks | SettledMasks | None = None) -> SamplerOutput:
        if not rows:
            return SamplerOutput([], [])
        settled = masks if isinstance(masks, SettledMasks) else self.settle_masks(rows, masks, self.vocab_size)
        seeds = np.fromiter(map(self._seed_of, rows), dtype=np.uint64, count=len(rows))
        positions = np.fromiter((len(r.prompt_token_ids) + len(r.output_token_ids) for r in rows),
                                dtype=np.uint64, count=len(rows))  # fmt: skip
        draws = _mix(seeds, positions)
        token_ids: list[int] = (draws % np.uint64(self.vocab_size)).astype(np.int64).tolist()  # a free row's token
        mask_row = {row: j for j, row in enumerate(settled.row_indices)}
        special = set(mask_row) | settled.deferred
        special.update(i for i, r in enumerate(rows) if r.params.min_tokens)
        for i in special:  # deferred, constrained or banning EOS: drawn among what is allowed
            if i in settled.deferred:
                token_ids[i] = -1
                continue
            bitmask = settled.bitmask[mask_row[i]] if i in mask_row and settled.bitmask is not None else None
            token_ids[i] = _pick(int(draws[i]), self.vocab_size, bitmask, _banned(rows[i]))
        if all(r.params.logprobs is None for r in rows):
            logprobs: list[TokenLogprob | None] = [None] * len(rows)
        else:
            logprobs = [None if r.params.logprobs is None or t < 0
                        else TokenLogprob(t, 0.0, ((t, 0.0),) if r.params.logprobs > 0 else ())
                        for r, t in zip(rows, token_ids, strict=True)]  # fmt: skip
        return SamplerOutput(token_ids, logprobs, settled.deferred)

    def start_sample(self, logits: torch.Tensor, rows: list[SamplingRow],
                     masks: PendingMasks | SettledMasks | None = None) -> PendingSample:
        """The tokens are computed on the host here: async scheduling gets them ready-made."""
        return PendingSample.ready(self.sample(logits, rows, masks), logits.device)

    def _seed_of(self, row: SamplingRow) -> int:
        if row.params.seed is not None:
            return row.params.seed & _MASK64
        if row.generator is not None:
            return row.generator.initial_seed() & _MASK64
        prompt = row.prompt_token_ids
        cached = self._prompt_seeds.get(id(prompt))
        if cached is not None and cached[0] is prompt:
            return cached[1]
        if len(self._prompt_seeds) >= _MAX_PROMPT_SEEDS:
            self._prompt_seeds.clear()
        seed = _prompt_seed(prompt)
        self._prompt_seeds[id(prompt)] = (prompt, seed)
        return seed


def _prompt_seed(prompt: list[int]) -> int:
    """A greedy request's seed: a hash of its prompt's head and tail, and its length."""
    head = np.asarray(prompt[:64] + prompt[-64:], dtype=np.int64)  # a prompt's hash needs no more
    return zlib.crc32(head.tobytes(), len(prompt))


def _mix(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """splitmix64 of ``seed * golden + position``, row by row (uint64)."""
    with np.errstate(over="ignore"):
        z = seeds * np.uint64(0x9E3779B97F4A7C15) + positions + np.uint64(0x632BE59BD9B4E019)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _banned(row: SamplingRow) -> tuple[int, ...]:
    """EOS and stop ids while ``min_tokens`` is not reached (as the real sampler bans them)."""
    p = row.params
    if not p.min_tokens or len(row.output_token_ids) >= p.min_tokens:
        return ()
    return tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(row.eos_token_ids))


def _pick(draw: int, vocab_size: int, bitmask: np.ndarray | None, banned: tuple[int, ...]) -> int:
    """The ``draw``-th allowed token: any token, or one whose bit is set in ``bitmask`` (int32 words)."""
    if bitmask is None and not banned:
        return draw % vocab_size
    if bitmask is None:
        allowed = np.setdiff1d(np.arange(vocab_size), banned)
    else:
        bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:vocab_size])
        if banned:
            allowed = np.setdiff1d(allowed, banned)
    if allowed.size == 0:  # a grammar that allows only what min_tokens bans: the grammar wins
        return _pick(draw, vocab_size, bitmask, ())
    return int(allowed[draw % allowed.size])
