"""Two "hosts" on 127.0.0.1 (issue 54): node 0 (this process: the engine, rank 0) and node 1
(``inflight serve --headless``, started separately) meet at ``--master-addr/--master-port`` and
give TP=1's tokens, with PP=2 (one rank per node) and TP=2 x PP=2 (two per node). A node that
never arrives fails the start with the command that would start it; a headless node whose
rank 0 never opens the store fails with the address it tried; LWS's variables are the defaults.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.runtime.config import EngineConfig
from inflight.runtime.distributed import headless, launcher
from inflight.runtime.distributed.rendezvous import resolve
from inflight.runtime.llm import LLM
from inflight.runtime.sampling_params import SamplingParams

PROMPTS = ["def fib(n):", "import os\nimport sys\n" * 3, "x", "class Node:\n    def __init__(self):"]
CONFIG = dict(num_kv_blocks=32, block_size=16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _headless(model_dir: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    """Node 1: the same command line a second host (or an LWS worker pod) runs."""
    cmd = [sys.executable, "-m", "inflight.runtime", "serve", str(model_dir), "--headless", "--nnodes", "2",
           "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), *extra]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2)], ids=["pp2", "tp2xpp2"])
def test_two_hosts_meet_at_the_address_and_match_tp1(model_factory, tp: int, pp: int) -> None:
    model_dir = model_factory("llama")
    params = SamplingParams(max_tokens=16, temperature=0.0)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11)
    with LLM(model_dir, **CONFIG) as one:
        want = [o.token_ids for o in one.generate(PROMPTS, params)] + [one.generate(PROMPTS[:1], seeded)[0].token_ids]
    port = _free_port()
    node1 = _headless(model_dir, port)  # flags differ from node 0's on purpose: it runs rank 0's config
    try:
        with LLM(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, nnodes=2, node_rank=0,
                 master_addr="127.0.0.1", master_port=port, **CONFIG) as two:
            remote = [r for r in range(1, tp * pp) if r not in two.engine.runner.workers._procs]
            assert remote == list(range(tp * pp // 2, tp * pp)), "node 0 started the other node's ranks itself"
            got = [o.token_ids for o in two.generate(PROMPTS, params)] + [two.generate(PROMPTS[:1], seeded)[0].token_ids]
        assert node1.wait(60) == 0, "node 1 did not stop cleanly with its engine"
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
    assert got == want


def test_a_node_that_never_arrives_fails_the_start_with_how_to_start_it(model_factory, monkeypatch) -> None:
    monkeypatch.setattr(launcher, "START_TIMEOUT_S", 2.0)
    port = _free_port()
    with pytest.raises(RuntimeError, match=rf"ranks \[1\] of other nodes never joined.*--headless --nnodes 2 "
                                           rf"--node-rank K --master-addr 127.0.0.1 --master-port {port}"):
        LLM(model_factory("llama"), pipeline_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port,
            **CONFIG)


def test_a_headless_node_without_rank_0_fails_with_the_address(model_factory, monkeypatch) -> None:
    monkeypatch.setattr(launcher, "START_TIMEOUT_S", 1.0)
    port = _free_port()
    config = EngineConfig(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=port)
    with pytest.raises(RuntimeError, match=rf"node 1 could not reach rank 0 at 127.0.0.1:{port}"):
        headless.run_headless(model_factory("llama"), config, environ={})


def test_headless_refuses_node_0_and_one_node() -> None:
    with pytest.raises(ValueError, match="--headless runs the workers of a node other than 0"):
        headless.run_headless("unused", EngineConfig(nnodes=2, node_rank=0), environ={})
    with pytest.raises(ValueError, match="--headless runs the workers"):
        headless.run_headless("unused", EngineConfig(), environ={})


def test_leaderworkerset_variables_are_the_defaults_and_flags_win() -> None:
    lws = {"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2", "LWS_LEADER_ADDRESS": "grp-0.grp.ns"}
    meet = resolve(EngineConfig(), lws)
    assert (meet.nnodes, meet.node_rank, meet.master_addr, meet.master_port) == (4, 2, "grp-0.grp.ns", 29500)
    assert meet.local_ranks(16) == range(8, 12)
    flags = resolve(EngineConfig(nnodes=2, node_rank=1, master_addr="10.0.0.5", master_port=1234), lws)
    assert (flags.nnodes, flags.node_rank, flags.master_addr, flags.master_port) == (2, 1, "10.0.0.5", 1234)
    one = resolve(EngineConfig(), {})
    assert (one.nnodes, one.node_rank, one.master_addr, one.master_port) == (1, 0, "127.0.0.1", None)
    with pytest.raises(ValueError, match="do not split evenly over nnodes 4"):
        meet.local_ranks(6)
    with pytest.raises(ValueError, match="node_rank 3 is not one of the 2 nodes"):
        resolve(EngineConfig(nnodes=2, node_rank=3), {})
    with pytest.raises(ValueError, match="LWS_WORKER_INDEX='x' is not a whole number"):
        resolve(EngineConfig(), {"LWS_WORKER_INDEX": "x"})
