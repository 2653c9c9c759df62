"""Through the whole server: an engine-core process (as ``inflight serve`` runs it) publishes by
connecting to a router's bound SUB socket (llm-d's central mode), and a completion's prompt
blocks arrive as BlockStored events under the configured topic, chained from the prompt's first
block, with the prompt's token ids."""

from __future__ import annotations

import json

import zmq

from inflight.runtime.config import EngineConfig
from inflight.runtime.server import ServerSettings
from tests.kv_events.vllm_structs import DECODER, BlockStored
from tests.server.server_helpers import MODEL_NAME, LiveServer, http

TOPIC = "kv@127.0.0.1:8000@demo"
BS = 4


def _chain(blocks: dict[int, tuple[int | None, list[int]]], prompt: list[int]) -> list[int]:
    """The longest chain of stored blocks that spells ``prompt`` from its first token."""
    children = {parent: (h, tokens) for h, (parent, tokens) in blocks.items()}
    out: list[int] = []
    parent = None
    while parent in children or parent is None:
        found = children.get(parent)
        if found is None or found[1] != prompt[len(out):len(out) + BS]:
            break
        parent, tokens = found
        out += tokens
    return out


def test_a_completions_prompt_blocks_reach_a_bound_subscriber(demo_model_dir) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{port}", "topic": TOPIC})
    config = EngineConfig(block_size=BS, num_kv_blocks=64, max_num_sequences=2, max_model_len=128,
                          kv_events_config=events)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    live = LiveServer(demo_model_dir, config, ServerSettings(model_name=MODEL_NAME), engine_process=True).start()
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks once the prompt is computed
    try:
        # The engine core's PUB has connected; a libzmq SUB sends its subscription once its own
        # thread handles the new connection, and the PUB drops what it sends before that.
        assert monitor.poll(30_000), "the engine core never connected to the subscriber"
        sub.poll(0)
        reply = http("POST", f"{live.url}/v1/completions",
                     {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert reply.status == 200, reply.body
        blocks: dict[int, tuple[int | None, list[int]]] = {}
        while len(_chain(blocks, prompt)) < 3 * BS:
            assert sub.poll(30_000), f"no KV event for the prompt's blocks (have {_chain(blocks, prompt)})"
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode() and len(seq) == 8
            for event in DECODER.decode(payload).events:
                if isinstance(event, BlockStored):
                    parent = event.parent_block_hash
                    for i, h in enumerate(event.block_hashes):
                        blocks[h] = (parent, event.token_ids[i * BS:(i + 1) * BS])
                        parent = h
        assert _chain(blocks, prompt) == prompt[:3 * BS]
    finally:
        live.stop()
        sub.disable_monitor()
        monitor.close(linger=0)
        sub.close(linger=0)
        ctx.term()
