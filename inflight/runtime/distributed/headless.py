"""A node that serves no HTTP: ``inflight serve MODEL --headless --nnodes N --node-rank K ...``.

Node ``K > 0`` of a multi-node group (:mod:`.rendezvous`) connects to rank 0's store at
``master_addr:master_port`` (waiting up to ``INFLIGHT_TP_START_TIMEOUT_S`` for node 0 to open it,
then failing with the address it tried), reads the engine's config that rank 0 published
there (so every rank runs rank 0's sizes, whatever flags this node got), and starts one worker
process per local rank (:mod:`.worker`). It then watches them: the group lives and dies as a
unit, so when any of them exits (rank 0 gone, a peer dead, a stop from rank 0) it stops the
others and exits, non-zero unless every worker exited cleanly. SIGTERM/SIGINT stop the workers
too. Knows nothing about requests or models beyond the directory it passes on.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType

import torch.distributed as dist

from inflight.runtime.config import EngineConfig
from inflight.runtime.distributed import launcher, rendezvous

logger = logging.getLogger("inflight.headless")
POLL_S = 0.2


def connect(meet: rendezvous.Rendezvous) -> dist.PrefixStore:
    """Rank 0's store, once node 0 has opened it; ``RuntimeError`` naming the address otherwise."""
    try:
        store = dist.TCPStore(meet.master_addr, meet.master_port or rendezvous.DEFAULT_PORT, is_master=False,
                              timeout=timedelta(seconds=launcher.START_TIMEOUT_S))  # fmt: skip
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(f"node {meet.node_rank} could not reach rank 0 at {meet.master_addr}:{meet.master_port} "
                           f"in {launcher.START_TIMEOUT_S:.0f} s ({exc}); is node 0 started with the same "
                           "--master-addr/--master-port?") from exc
    keys = dist.PrefixStore(launcher.KEY_PREFIX, store)
    keys.wait(["config"])  # rank 0 publishes it before it waits for the ranks
    return keys


def run_headless(model_dir: str | Path, config: EngineConfig, environ: dict[str, str] | None = None) -> int:
    """Start and watch this node's workers; the exit code of the node (see module docstring)."""
    meet = rendezvous.resolve(config, os.environ if environ is None else environ)
    if meet.nnodes < 2 or meet.node_rank == 0:
        raise ValueError("--headless runs the workers of a node other than 0: give --nnodes N (> 1) and --node-rank K "
                         "(1..N-1), or run in a LeaderWorkerSet pod (LWS_GROUP_SIZE, LWS_WORKER_INDEX).")
    keys = connect(meet)
    engine_config = EngineConfig(**json.loads(keys.get("config")))
    world = engine_config.tensor_parallel_size * engine_config.pipeline_parallel_size
    ranks = meet.local_ranks(world)
    logger.info("node %d of %d: starting ranks %d..%d of %d (rank 0 at %s:%s)", meet.node_rank, meet.nnodes,
                ranks.start, ranks.stop - 1, world, meet.master_addr, meet.master_port)
    port = meet.master_port or rendezvous.DEFAULT_PORT
    procs = {r: launcher._spawn(r, world, port, model_dir, engine_config, host=meet.master_addr) for r in ranks}
    stopping: list[int] = []

    def stop(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    return watch(procs, stopping)


def watch(procs: dict[int, subprocess.Popen[bytes]], stopping: list[int]) -> int:
    """Wait until a worker exits or a stop signal arrives; stop the rest; the node's exit code."""
    while not stopping and all(p.poll() is None for p in procs.values()):
        time.sleep(POLL_S)
    exited = {r: p.returncode for r, p in procs.items() if p.poll() is not None}
    for rank, code in exited.items():
        if code != 0:
            logger.error("%s; stopping this node's other ranks", launcher.describe_exit(rank, procs[rank]))
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    for proc in procs.values():
        proc.wait()
    clean = not stopping and all(code == 0 for code in exited.values())
    return 0 if clean else 1
