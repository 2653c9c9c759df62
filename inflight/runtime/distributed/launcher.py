"""Rank 0's side of tensor parallelism: start the worker processes, supervise them, stop them.

:meth:`WorkerGroup.start` runs in the engine process (rank 0). It checks that the model
splits, opens a ``TCPStore`` on 127.0.0.1 (an OS-chosen port, so no race for a free one),
starts ranks 1..N-1 as ``python -m inflight.runtime.distributed.worker`` subprocesses and
waits for them with their processes in view: a worker that exits, or reports an error,
during start-up fails the start at once with that worker's message (never a wait for a
rendezvous timeout). Then a monitor thread polls the workers; a dead one turns the next
:meth:`check` or step into :class:`EngineFatalError`, and so does any error raised while
the ranks are inside a step (they are then out of step for good). A step may instead block
for good in a collective with the dead rank (the step channel's broadcasts wait without a
timeout, for idle workers, and gloo does not always see a killed peer's connection close):
if the group is not closed within ``STUCK_GRACE_S`` of the death, the monitor calls the
owner's :attr:`WorkerGroup.on_stuck` (the engine-core process exits, so its front end answers
every client; none: the front end's stall watchdog ends it later). :meth:`close` stops the
workers (and kills what does not stop), also at interpreter exit; workers exit by themselves
when the engine process disappears (:mod:`.worker`). Knows nothing about the model.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from inflight import env_vars
from inflight.runtime.config import EngineConfig
from inflight.runtime.distributed import rendezvous
from inflight.runtime.distributed.comm import StepTensors, TensorParallel
from inflight.runtime.distributed.lora_wire import encode_adapter
from inflight.runtime.distributed.pipeline import join_stages
from inflight.runtime.model.batch import StepInputs
from inflight.runtime.model.layout import shard_layout
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config
from inflight.runtime.model.stages import split_layers
from inflight.runtime.outputs import EngineFatalError

logger = logging.getLogger(__name__)
T = TypeVar("T")

HOST = "127.0.0.1"
KEY_PREFIX = "inflight/"
POLL_S = 0.05
MONITOR_S = 0.2
# How long start-up (loading every shard) may take, and one collective inside a step.
START_TIMEOUT_S: float = env_vars.read_float("INFLIGHT_TP_START_TIMEOUT_S")  # type: ignore[assignment]
COLLECTIVE_TIMEOUT_S: float = env_vars.read_float("INFLIGHT_TP_COLLECTIVE_TIMEOUT_S")  # type: ignore[assignment]
IDLE_TIMEOUT = timedelta(days=3650)  # the control group: idle workers wait here
# After a worker died: how long the engine thread has to fail its step and close the group
# before the monitor takes it for blocked in a collective with the dead rank (WorkerGroup.on_stuck).
STUCK_GRACE_S = 5.0


def backend_for(device: str) -> str:
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def init_groups(store: dist.Store, rank: int, world_size: int, backend: str) -> dist.ProcessGroup:
    """Join the default group (the model's collectives) and return the gloo control group.

    Every rank makes the same calls in the same order.
    """
    dist.init_process_group(
        backend, store=dist.PrefixStore("pg/", store), rank=rank, world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def describe_exit(rank: int, proc: subprocess.Popen[bytes]) -> str:
    code = proc.returncode
    how = f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exited with code {code}"
    return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"


class WorkerGroup:
    """Ranks 1..N-1 as seen from rank 0. Build with :meth:`start`."""

    def __init__(self, store: dist.TCPStore, procs: dict[int, subprocess.Popen[bytes]], world_size: int) -> None:
        self._store = store
        self._keys = dist.PrefixStore(KEY_PREFIX, store)
        self._procs = procs
        self.world_size = world_size
        self.tp: TensorParallel | None = None
        self._failure: str | None = None
        self._remote_hint = ""  # how to start the other nodes' ranks, for the message when they never join
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._monitor = threading.Thread(target=self._watch, name="inflight-tp-monitor", daemon=True)
        # called on the monitor thread with the failure when a worker died and the group is still
        # open STUCK_GRACE_S later: the engine thread is blocked (see module docstring)
        self.on_stuck: Callable[[str], None] | None = None
        self.stuck_grace_s = STUCK_GRACE_S
        atexit.register(self.close)

    @classmethod
    def start(cls, model_dir: str | Path, config: EngineConfig) -> WorkerGroup:
        """Start ranks 1..N-1 and join the process groups as rank 0 (see module docstring)."""
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        spec = spec_from_hf_config(load_hf_config(model_dir))
        shard_layout(spec, 0, config.tensor_parallel_size)  # splits? else ValueError
        split_layers(spec.num_layers, config.pipeline_parallel_size)  # enough layers? else ValueError
        meet = rendezvous.resolve(config, os.environ)  # several nodes: the others run --headless
        if meet.node_rank != 0:
            raise ValueError(f"node_rank {meet.node_rank} runs workers only: start it with --headless (node 0 runs "
                             "the engine and the server).")
        local = meet.local_ranks(world)
        if dist.is_initialized():
            raise ValueError("a tensor-parallel engine is already running in this process; close it first.")
        host = meet.master_addr if meet.nnodes > 1 else HOST
        store = dist.TCPStore(host, meet.master_port or 0, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=START_TIMEOUT_S))
        procs = {r: _spawn(r, world, store.port, model_dir, config, host) for r in local if r != 0}
        group = cls(store, procs, world)
        if meet.nnodes > 1:  # the other nodes' workers read the engine's config from here
            group._keys.set("config", json.dumps(config.to_dict()))
            group._remote_hint = f"; start them with `{meet.headless_command(str(model_dir))}` on each other node"
        try:
            group._wait_for_keys("joined")
            control = init_groups(store, 0, world, backend_for(config.device))
            group.tp = join_stages(0, config.tensor_parallel_size, config.pipeline_parallel_size, spec.num_layers,
                                   control, group._agree_num_blocks, backend_for(config.device),
                                   timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        except BaseException:
            group.close()
            raise
        group._monitor.start()
        return group

    # -- start-up -----------------------------------------------------------------------------
    def _wait_for_keys(self, stage: str) -> list[str]:
        """Wait until every worker has set ``stage/<rank>``; fail at once if one dies or errs."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = set(range(1, self.world_size))  # this node's workers and the other nodes' ranks
        values: dict[int, str] = {}
        while pending:
            for rank in sorted(pending):
                if self._keys.check([f"error/{rank}"]):
                    message = self._keys.get(f"error/{rank}").decode()
                    raise RuntimeError(f"tensor-parallel worker rank {rank} failed to start: {message}")
                if self._keys.check([f"{stage}/{rank}"]):
                    values[rank] = self._keys.get(f"{stage}/{rank}").decode()
                    pending.discard(rank)
                elif rank in self._procs and self._procs[rank].poll() is not None:
                    raise RuntimeError(describe_exit(rank, self._procs[rank]) + " during start-up (see its log above)")
            if pending and time.monotonic() > deadline:
                remote = sorted(pending - set(self._procs))
                raise RuntimeError(f"tensor-parallel workers {sorted(pending)} did not start in {START_TIMEOUT_S:.0f} s"
                                   + (f" (ranks {remote} of other nodes never joined{self._remote_hint})"
                                      if remote else ""))  # fmt: skip
            if pending:
                time.sleep(POLL_S)
        return [values[r] for r in sorted(values)]

    def _agree_num_blocks(self, local: int) -> int:
        """The smallest KV block count any rank can hold; told to every worker."""
        num = min([local, *(int(v) for v in self._wait_for_keys("blocks"))])
        self._keys.set("blocks/final", str(num))
        return num

    # -- supervision --------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closed.wait(MONITOR_S):
            for rank, proc in self._procs.items():
                if proc.poll() is not None and not self._closed.is_set():
                    self._fail(describe_exit(rank, proc))
                    if not self._closed.wait(self.stuck_grace_s) and self.on_stuck is not None:
                        self.on_stuck(self._failure or describe_exit(rank, proc))
                    return

    def _fail(self, message: str) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = message
                logger.error("%s; the engine cannot go on", message)

    @property
    def failure(self) -> str | None:
        return self._failure

    def check(self) -> None:
        """Raise :class:`EngineFatalError` if a worker has died or a step failed."""
        if self._failure is None:
            for rank, proc in self._procs.items():
                if proc.poll() is not None:
                    self._fail(describe_exit(rank, proc))
        if self._failure is not None:
            raise EngineFatalError(self._failure)

    def run_step(self, forward: Callable[[], T], step: StepTensors) -> T:
        """Broadcast ``step`` and run rank 0's ``forward``; any failure is fatal."""

        def broadcast_and_forward() -> T:
            assert self.tp is not None
            self.tp.send_step(StepInputs(*step))
            return forward()

        return self._fatal_on_failure(broadcast_and_forward, "tensor-parallel step")

    def launch_step(self, forward: Callable[[], T], step: StepTensors) -> tuple[list[dist.Work], T]:
        """Pipeline stages: start broadcasting ``step`` without waiting for the workers (the later
        stages join once they finish the steps before it; the broadcast's work handles are
        returned) and run rank 0's ``forward`` (its stage, its sends posted); any failure is
        fatal, as in :meth:`run_step`."""
        assert self.tp is not None
        tp = self.tp
        return self.guard(lambda: (tp.send_step(StepInputs(*step), wait=False), forward()))

    def guard(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` (a part of a step); a failure leaves the ranks out of step, so it is fatal."""
        return self._fatal_on_failure(fn, "distributed step")

    def _fatal_on_failure(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` after :meth:`check`; an error turns into :class:`EngineFatalError` naming the
        dead workers if any (else ``what`` and the error), an interrupt is recorded as fatal."""
        self.check()
        assert self.tp is not None
        try:
            return fn()
        except Exception as exc:
            time.sleep(MONITOR_S)  # let a dying worker's exit status land, for the message
            dead = [describe_exit(r, p) for r, p in self._procs.items() if p.poll() is not None]
            self._fail("; ".join(dead) if dead else f"{what} failed: {exc}")
            raise EngineFatalError(self._failure or str(exc)) from exc
        except BaseException as exc:  # KeyboardInterrupt mid-step: the ranks are out of step
            self._fail(f"a {what} was interrupted ({type(exc).__name__})")
            raise

    def load_lora(self, slot: int, tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Send a LoRA adapter's tensors for device slot ``slot`` to every worker (before the step
        that uses it, on the same channel, so they load it first); any failure is fatal."""
        self.check()
        assert self.tp is not None
        try:
            self.tp.send_lora(encode_adapter(slot, tensors))
        except Exception as exc:
            self._fail(f"sending a LoRA adapter to the tensor-parallel workers failed: {exc}")
            raise EngineFatalError(self._failure or str(exc)) from exc

    # -- stop ---------------------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every worker (a stop message, then SIGKILL for what is left) and leave the groups."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
        atexit.unregister(self.close)
        alive = all(p.poll() is None for p in self._procs.values())
        stopping = self.tp is not None and alive and self._failure is None
        if stopping:
            try:
                self.tp.send_stop()
            except Exception:  # noqa: BLE001 (a worker went away meanwhile: killed below)
                logger.warning("could not send stop to the tensor-parallel workers", exc_info=True)
                stopping = False
        if not stopping:  # failed, or never got to the step loop: nothing to wait for
            for proc in self._procs.values():
                if proc.poll() is None:
                    proc.kill()
        deadline = time.monotonic() + timeout_s
        for proc in self._procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._monitor.is_alive():
            self._monitor.join(timeout=1.0)


def _log_format() -> str:
    """``json`` when this process logs JSON lines (``inflight serve --log-format json``), else ``text``."""
    root = logging.getLogger()
    return "json" if any(type(h.formatter).__name__ == "JsonFormatter" for h in root.handlers) else "text"


def _spawn(rank: int, world: int, port: int, model_dir: str | Path, config: EngineConfig,
           host: str = HOST) -> subprocess.Popen[bytes]:  # fmt: skip
    cmd = [
        sys.executable, "-m", "inflight.runtime.distributed.worker",
        "--rank", str(rank), "--world-size", str(world), "--port", str(port), "--master-addr", host,
        "--model-dir", str(model_dir), "--config", json.dumps(config.to_dict()),
        "--log-format", _log_format(), "--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel()),
    ]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
