"""Where the ranks of a multi-node group meet: rank 0's address, this node's index, the split.

``nnodes`` nodes (hosts, or pods of a LeaderWorkerSet group) hold ``tensor_parallel_size x
pipeline_parallel_size`` ranks, the same number on each, numbered node by node: node ``k`` holds
ranks ``k * per_node`` to ``(k + 1) * per_node - 1``. Node 0 runs the engine (rank 0: the
scheduler, the HTTP front end) and opens the rendezvous store (a ``TCPStore``) on
``master_addr:master_port``; every other node runs ``inflight serve ... --headless``
(:mod:`.headless`), which starts its ranks' workers against that address. Settings left unset
come from the variables LeaderWorkerSet puts in every pod (``LWS_GROUP_SIZE``,
``LWS_WORKER_INDEX``, ``LWS_LEADER_ADDRESS``), else one node on 127.0.0.1. vLLM's spellings:
``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``. Knows nothing about models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_PORT = 29500  # torch.distributed's customary MASTER_PORT
LOCAL_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """How the ranks find each other (see module docstring). ``master_port`` None: any free port
    (one node: nobody else needs to know it)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None

    def ranks_per_node(self, world_size: int) -> int:
        if world_size % self.nnodes:
            raise ValueError(f"{world_size} ranks (tensor_parallel_size x pipeline_parallel_size) do not split evenly "
                             f"over nnodes {self.nnodes}; each node must hold the same number of ranks.")
        if world_size < self.nnodes:
            raise ValueError(f"nnodes {self.nnodes} exceeds the {world_size} ranks to place.")
        return world_size // self.nnodes

    def local_ranks(self, world_size: int) -> range:
        per_node = self.ranks_per_node(world_size)
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    def headless_command(self, model: str) -> str:
        """The command that starts node ``k``'s ranks (for error messages)."""
        return (f"inflight serve {model} --headless --nnodes {self.nnodes} --node-rank K "
                f"--master-addr {self.master_addr} --master-port {self.master_port}")


def resolve(config: Any, environ: Mapping[str, str]) -> Rendezvous:
    """The rendezvous for ``config`` (an EngineConfig): its fields, else LWS's variables, else one node."""
    nnodes = config.nnodes if config.nnodes is not None else _env_int(environ, "LWS_GROUP_SIZE", 1)
    node_rank = config.node_rank if config.node_rank is not None else _env_int(environ, "LWS_WORKER_INDEX", 0)
    addr = config.master_addr or environ.get("LWS_LEADER_ADDRESS") or LOCAL_HOST
    port = config.master_port if config.master_port is not None else (DEFAULT_PORT if nnodes > 1 else None)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank {node_rank} is not one of the {nnodes} nodes (0..{nnodes - 1}).")
    return Rendezvous(nnodes, node_rank, addr, port)


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    text = environ.get(name)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a whole number (LeaderWorkerSet sets it in each pod).") from None
