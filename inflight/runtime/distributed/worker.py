"""A tensor-parallel worker (ranks 1..N-1): ``python -m inflight.runtime.distributed.worker``.

Started by :mod:`.launcher` in the engine process, never by hand. It joins the groups
through rank 0's ``TCPStore``, loads its shard of the weights, allocates its shard of the KV
cache (the block count agreed with rank 0), then runs every step rank 0 broadcasts until
rank 0 says stop. A start-up error is written to the store for rank 0 to report. It
ignores SIGINT/SIGTERM (rank 0 drains and then stops it) and exits by itself if rank 0's
process disappears, so no worker outlives its engine. Knows nothing about requests.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
import traceback
from datetime import timedelta

import torch.distributed as dist

from inflight.runtime.config import EngineConfig
from inflight.runtime.distributed.comm import LoRALoad
from inflight.runtime.distributed.launcher import (
    COLLECTIVE_TIMEOUT_S,
    HOST,
    KEY_PREFIX,
    START_TIMEOUT_S,
    backend_for,
    init_groups,
)
from inflight.runtime.distributed.lora_wire import decode_adapter
from inflight.runtime.distributed.pipeline import join_stages
from inflight.runtime.logs import configure_logging, dump_stacks_on_signal
from inflight.runtime.model.loader import load_hf_config
from inflight.runtime.model.spec import spec_from_hf_config

PARENT_POLL_S = 0.5


def _exit_with_parent(parent_pid: int) -> None:
    """Leave at once when the engine process is gone (its children are re-parented)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(3)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m inflight.runtime.distributed.worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--master-addr", default=HOST, help="where rank 0's store listens (another node's address)")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--log-format", choices=("text", "json"), default="text", help="as the engine process logs")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def _configure_logging(rank: int, fmt: str, level: str) -> logging.Logger:
    """Log like the engine process: JSON lines (the logger name carries the rank) or text."""
    level = level if level in logging.getLevelNamesMapping() else "INFO"
    if fmt == "json":
        configure_logging(level, "json")
    else:
        logging.basicConfig(level=level, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    return logging.getLogger(f"inflight.tp-worker.rank{rank}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logger = _configure_logging(args.rank, args.log_format, args.log_level)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    dump_stacks_on_signal()
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    store = dist.TCPStore(args.master_addr, args.port, args.world_size, is_master=False,
                          timeout=timedelta(seconds=START_TIMEOUT_S))
    keys = dist.PrefixStore(KEY_PREFIX, store)
    try:
        config = EngineConfig(**json.loads(args.config))
        from inflight.runtime.worker.model_runner import ModelRunner

        keys.set(f"joined/{args.rank}", "1")
        control = init_groups(store, args.rank, args.world_size, backend_for(config.device))

        def agree_num_blocks(local: int) -> int:
            keys.set(f"blocks/{args.rank}", str(local))
            keys.wait(["blocks/final"])
            return int(keys.get("blocks/final"))

        num_layers = spec_from_hf_config(load_hf_config(args.model_dir)).num_layers
        tp = join_stages(args.rank, config.tensor_parallel_size, config.pipeline_parallel_size, num_layers, control,
                         agree_num_blocks, backend_for(config.device), timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        runner = ModelRunner(args.model_dir, config, None, tp=tp)
    except BaseException as exc:
        keys.set(f"error/{args.rank}", f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return 1
    logger.info("loaded its shard: %d KV blocks on %s", runner.num_kv_blocks, runner.device)
    while (step := tp.receive_step(runner.device)) is not None:
        if isinstance(step, LoRALoad):  # an adapter for a device slot, before the step using it
            if runner.lora_slots is None:
                raise RuntimeError("rank 0 sent a LoRA adapter to a worker without LoRA slots")
            runner.lora_slots.load(*decode_adapter(step.payload, runner.spec))
            continue
        runner.execute_received((step.input_ids, step.positions, step.meta, step.sample_indices))
    logging.shutdown()
    os._exit(0)  # nothing to clean up; interpreter and process-group teardown take seconds


if __name__ == "__main__":
    raise SystemExit(main())
