"""KV events a router can follow (vLLM's ``--kv-events-config``): which prefix-cache blocks this
engine stores and evicts, sent as vLLM's msgpack ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` batches on a ZMQ PUB socket with sequence numbers and a replay socket, so
llm-d's KV-cache indexer (the endpoint picker's precise-prefix scorer) consumes them unchanged.

events: the event types and their bytes; config: the JSON config; collector: what the block
pool changed in one step; publisher: the ZMQ sockets and their thread; stream: the two together,
the engine's handle. Imports no torch; ``zmq`` only when a publisher opens. docs/kv-events.md.
"""
